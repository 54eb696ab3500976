"""A file too large for one call to the GPU machine, sent in chunks over consecutive calls (stdlib only).

A call carries the tracked tree plus the paths it names, 64 MiB in all, so a file (the 94 MiB GGUF) goes
in chunks: ``split`` cuts it into parts that each fit beside the tree, with a manifest of their sizes and
sha256 digests; each call carries one part (an ignored path that no later call names) and ``stash``es it
in a folder on the device that outlives the call while the machine stays warm; the last call ``join``s
the parts and checks the whole file's sha256. A part that is missing (the machine went cold between
calls) or corrupt is named in one sentence, and the random-weight check still runs without the file.

    python -m specdeploy.exporter.bench.gpu_transfer plan FILE          # how many calls, how large a part
    python -m specdeploy.exporter.bench.gpu_transfer split FILE DIR     # DIR/part-000 ..., DIR/parts.json
    python -m specdeploy.exporter.bench.gpu_transfer stash DIR STORE    # on the device, each call
    python -m specdeploy.exporter.bench.gpu_transfer join STORE OUT     # on the device, the last call
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one call carries: the tracked tree, untracked files and the named paths
MARGIN = 1 * MIB  # room for untracked scratch files beside the tree and the part
MIN_PART = 4 * MIB  # below this a transfer takes too many calls to be worth it
MANIFEST = "parts.json"
# Small files that ride with a part: the real-weights stage's prompt ids (gpu_real.py, with the first part) and
# the device training's prompts (exporter/train/ondevice.py prepare, with the last, smallest part).
EXTRAS = ("prompts.json", "train-prompts.npz")


class TransferError(Exception):
    """A transfer that cannot be planned or reassembled, in one sentence."""


@dataclass(frozen=True)
class TransferPlan:
    tree_bytes: int
    part_bytes: int
    calls: int

    def fits(self) -> bool:
        return self.part_bytes >= MIN_PART


def tree_bytes(root: Path) -> int:
    """The bytes of every tracked file (what each call carries before any named path)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return sum((root / name).stat().st_size for name in out.decode().split("\0") if name and (root / name).is_file())


def plan(size: int, tree: int, limit: int = CALL_LIMIT) -> TransferPlan:
    """Parts as large as fit beside ``tree`` bytes in one call, and how many calls ``size`` bytes take."""
    part = max(0, limit - tree - MARGIN) // MIB * MIB
    calls = -(-size // part) if part else 0
    return TransferPlan(tree, part, calls)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split(src: Path, out: Path, part_bytes: int) -> list[Path]:
    """Cut ``src`` into ``out/part-NNN`` of at most ``part_bytes`` each, and write ``out/parts.json``."""
    if not src.is_file():
        raise TransferError(f"There is no file at '{src}' to send.")
    if part_bytes < 1:
        raise TransferError("A part must hold at least one byte.")
    out.mkdir(parents=True, exist_ok=True)
    parts, digests = [], []
    with src.open("rb") as fh:
        while block := fh.read(part_bytes):
            path = out / f"part-{len(parts):03d}"
            path.write_bytes(block)
            parts.append(path)
            digests.append({"name": path.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"file": src.name, "bytes": src.stat().st_size, "sha256": _sha256(src), "parts": digests}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return parts


def stash(carried: Path, store: Path) -> list[str]:
    """Move the parts (the manifest, and the prompts files that may ride with them) a call carried in ``carried``
    into ``store``; returns their names."""
    store.mkdir(parents=True, exist_ok=True)
    moved = []
    for path in sorted(carried.iterdir()) if carried.is_dir() else []:
        if path.name in (MANIFEST, *EXTRAS) or path.name.startswith("part-"):
            shutil.copyfile(path, store / path.name)
            moved.append(path.name)
    return moved


def join(store: Path, dest: Path) -> Path:
    """Reassemble the file from ``store``'s parts into ``dest``, checking every part and the whole."""
    try:
        manifest = json.loads((store / MANIFEST).read_text())
    except (OSError, ValueError):
        raise TransferError(f"'{store}' holds no readable {MANIFEST}: send the first part again.") from None
    missing = [p["name"] for p in manifest["parts"] if not (store / p["name"]).is_file()]
    if missing:
        raise TransferError(f"{len(missing)} of {len(manifest['parts'])} parts never arrived ({', '.join(missing)}): "
                            f"the machine went cold between calls, so send them again.")
    tmp = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    with tmp.open("wb") as fh:
        for p in manifest["parts"]:
            block = (store / p["name"]).read_bytes()
            if len(block) != p["bytes"] or hashlib.sha256(block).hexdigest() != p["sha256"]:
                tmp.unlink()
                raise TransferError(f"Part {p['name']} is corrupt (its sha256 differs from the manifest's).")
            fh.write(block)
            h.update(block)
    if h.hexdigest() != manifest["sha256"]:
        tmp.unlink()
        raise TransferError(f"The reassembled {manifest['file']} differs from the original (sha256).")
    tmp.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("file", type=Path)
    p = sub.add_parser("split")
    p.add_argument("file", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--part-mib", type=int, default=None, help="default: as large as fits beside the tree")
    p = sub.add_parser("stash")
    p.add_argument("carried", type=Path)
    p.add_argument("store", type=Path)
    p = sub.add_parser("join")
    p.add_argument("store", type=Path)
    p.add_argument("dest", type=Path)
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    try:
        if args.cmd in ("plan", "split"):
            if not args.file.is_file():
                raise TransferError(f"There is no file at '{args.file}' to send.")
            tp = plan(args.file.stat().st_size, tree_bytes(root))
            asked = getattr(args, "part_mib", None)  # split's option; plan has none
            part = asked * MIB if asked else tp.part_bytes
            if args.cmd == "plan" or not tp.fits():
                print(f"tree {tp.tree_bytes / MIB:.1f} MiB; parts of {tp.part_bytes / MIB:.0f} MiB; "
                      f"{tp.calls} calls for {args.file.stat().st_size / MIB:.1f} MiB")
            if not tp.fits() and not asked:
                raise TransferError(f"The tracked tree ({tp.tree_bytes / MIB:.1f} MiB) leaves only "
                                    f"{tp.part_bytes / MIB:.0f} MiB per call, {tp.calls} calls for this file: "
                                    f"slim the tree first.")
            if args.cmd == "split":
                parts = split(args.file, args.out, part)
                print(f"{len(parts)} parts in {args.out}")
        elif args.cmd == "stash":
            print(f"stashed {' '.join(stash(args.carried, args.store)) or 'nothing'} in {args.store}")
        else:
            print(f"reassembled {join(args.store, args.dest)} (sha256 checked)")
    except TransferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
