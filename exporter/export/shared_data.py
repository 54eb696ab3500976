"""Weights stored once per bundle: ONNX external data that several graphs point to.

A graph's large initializer that another graph of the bundle already holds byte for byte (same dtype,
shape and bytes) is not written again: its external-data entry points at the other graph's data file
(``location``, ``offset``, ``length``), which ONNX Runtime and TensorRT's parser read like any other.
The Chimera draft's embedding table is the base's own, for instance, and a heads draft's full lm_head
is the base's tied embedding. The manifest lists every data file a graph reads, so the bundle's hash
check covers the shared file too, and a replaced graph never removes a file another graph still reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

MIN_SHARED_BYTES = 1 << 20  # smaller tensors are not worth a lookup
_ALIGN = 4096  # offsets of the tensors a graph keeps, page-aligned so that they can be memory-mapped


def _external(tensor) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _set_external(tensor, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _read(bundle_dir: Path, ext: dict[str, str]) -> bytes:
    with open(bundle_dir / ext["location"], "rb") as fh:
        fh.seek(int(ext.get("offset", 0)))
        return fh.read(int(ext["length"])) if "length" in ext else fh.read()


def _external_tensors(proto) -> list:
    import onnx

    return [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def share_weights(bundle_dir: Path, file: str, others: list[str], min_bytes: int = MIN_SHARED_BYTES) -> int:
    """Point ``file``'s external tensors that one of the graphs ``others`` holds at that graph's bytes.

    ``file``'s own data file is rewritten with only the tensors it keeps (or removed when it keeps
    none). Tensors under ``min_bytes`` are kept as they are (a second form of the same graph shares them
    all: its per-layer 4-bit blocks are a few hundred KiB each). Returns the bytes saved.
    """
    import onnx

    bundle_dir = Path(bundle_dir)
    proto = onnx.load(str(bundle_dir / file), load_external_data=False)
    mine = _external_tensors(proto)
    shapes = {(t.data_type, tuple(t.dims)) for t in mine if int(_external(t).get("length", 0)) >= min_bytes}
    held: dict[tuple, dict[str, str]] = {}
    for other in others:
        for t in _external_tensors(onnx.load(str(bundle_dir / other), load_external_data=False)):
            ext = _external(t)
            if (t.data_type, tuple(t.dims)) in shapes and int(ext.get("length", 0)) >= min_bytes:
                held.setdefault((t.data_type, tuple(t.dims), hashlib.sha256(_read(bundle_dir, ext)).digest()), ext)
    if not held:
        return 0
    own = f"{file}.data"
    tmp = bundle_dir / f"{own}.tmp-{os.getpid()}"
    saved, offset = 0, 0
    try:
        with open(tmp, "wb") as out:  # a new file, never the (hard-linked) old one
            for t in mine:
                ext = _external(t)
                data = _read(bundle_dir, ext)
                if ext["location"] != own:  # already elsewhere (shared before): leave it
                    continue
                match = held.get((t.data_type, tuple(t.dims), hashlib.sha256(data).digest()))
                if match is not None:
                    _set_external(t, match["location"], int(match.get("offset", 0)), len(data))
                    saved += len(data)
                    continue
                offset += -offset % _ALIGN
                out.seek(offset)
                out.write(data)
                _set_external(t, own, offset, len(data))
                offset += len(data)
        if saved == 0:
            return 0
        if offset:
            os.replace(tmp, bundle_dir / own)
        else:
            (bundle_dir / own).unlink(missing_ok=True)
        model_tmp = bundle_dir / f"{file}.tmp-{os.getpid()}"
        onnx.save(proto, str(model_tmp))  # a new file: the staged bundle's files are hard links to the live one's
        os.replace(model_tmp, bundle_dir / file)
        return saved
    finally:
        tmp.unlink(missing_ok=True)


def store_once(bundle_dir: Path, file: str, others: list[str], progress, min_bytes: int = MIN_SHARED_BYTES) -> int:
    """:func:`share_weights`, with one progress line saying how much was shared."""
    saved = share_weights(bundle_dir, file, others, min_bytes)
    if saved:
        progress(f"      {file}: {saved / 2**20:.0f} MiB of weights already in {', '.join(others)}; stored once")
    return saved


def weight_bytes(bundle_dir: Path, file: str) -> int:
    """Bytes of external weights the graph ``file`` reads, wherever they are stored."""
    import onnx

    proto = onnx.load(str(Path(bundle_dir) / file), load_external_data=False)
    return sum(int(_external(t).get("length", 0)) for t in _external_tensors(proto))


def stored_twice(bundle_dir: Path, files: list[str]) -> list[tuple[str, str]]:
    """Pairs of large tensors (``file:name``) that the graphs ``files`` store twice with the same bytes."""
    import onnx

    bundle_dir = Path(bundle_dir)
    seen: dict[tuple, tuple[str, str, str]] = {}  # content -> (where it is stored, first file:name)
    twice = []
    for file in files:
        for t in _external_tensors(onnx.load(str(bundle_dir / file), load_external_data=False)):
            ext = _external(t)
            if int(ext.get("length", 0)) < MIN_SHARED_BYTES:
                continue
            key = (t.data_type, tuple(t.dims), hashlib.sha256(_read(bundle_dir, ext)).digest())
            where = f"{ext['location']}@{ext.get('offset', 0)}"
            if key in seen and seen[key][0] != where:
                twice.append((seen[key][1], f"{file}:{t.name}"))
            seen.setdefault(key, (where, f"{file}:{t.name}"))
    return twice
