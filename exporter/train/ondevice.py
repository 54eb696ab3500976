"""Draft training on a lent GPU, prepared: the device has torch but no tokenizer, ShareGPT or transformers.

Three commands (``python -m specdeploy.exporter.train.ondevice ...``):

1. ``prepare`` (here, with the exporter): the training prompts exactly as ``specdeploy train`` selects them
   (:func:`~.sharegpt.select_sequences`, self-distilled replies, the shipped Chimera's feature layers) as
   token ids, with the reply-text token counts that order the draft vocabulary, the base's weight hash and
   its end-of-turn ids: one ``train-prompts.npz`` of a few MB that rides with a GGUF part
   (``gpu_transfer stash`` keeps it).
2. ``run`` (on the device; ``bash scripts/gpu_check.sh --train``): the GGUF read without transformers
   (:func:`~specdeploy.exporter.bench.gpu_real.read_gguf`, checked against the weight hash), the torch
   backend in fp32 with the Chimera's taps, batched greedy replies with every position's hidden state,
   tapped layers and label (:class:`~.selfdistill.BatchGenerator`) into a training cache
   (:func:`~.data.build_cache`), then Chimera and Cerberus trained there, each under a time limit. Writes
   ``chimera.safetensors`` and ``cerberus.safetensors`` (int8 rows with fp16 scales, as the shipped drafts are
   stored; each checked under 16 MiB, the most a file may weigh on its way back) and ``train.json`` (stages,
   data and held-out metrics). ``--dry-run``: the same on CPU torch, a few sequences and seconds (CI).
3. ``keep`` (here, after the weights came back): each new draft against the shipped one on MT-bench
   prompts, decoded by the runtime on this CPU with the model drafting every step (tau: tokens per
   verify step; every output checked identical to plain decoding). A new draft replaces the shipped one,
   recalibrated for this machine, only where its tau is higher. Writes ``keep.json`` and ``keep.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from specdeploy.runtime.drafters.kinds import CERBERUS, CERBERUS_NOGATE, CHIMERA
from specdeploy.runtime.errors import SpecDeployError, TrainingError

WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "graphs" / "weights"  # the shipped drafts (tracked)
PROMPTS_FILE = "train-prompts.npz"
KINDS = (CHIMERA, CERBERUS)
MAX_FILE_BYTES = 16 << 20  # a file that comes back from the device
PROMPTS_BOUND = 4 << 20  # train-prompts.npz rides with the GGUF's last part; its call must stay under 64 MiB
KEEP_TREE = "tree16"  # both drafts weighed on one tree (on a chains plan: its main path), whatever they calibrated


@dataclass(frozen=True)
class Budget:
    """One run's sizes and time limits (seconds): the device's fit a 10-minute call beside ``--real``."""

    data_s: float | None
    chimera_s: float
    cerberus_s: float
    gen_batch: int  # sequences generated together (one cache shard)
    chimera_batch: int  # sequences per Chimera step
    heads_batch: int  # positions per Cerberus step
    epochs: int
    max_seqs: int | None = None  # at most this many of the prepared prompts
    heldout_fraction: float | None = None  # None: the prepared data's (a dry run's few sequences need more)
    shortest: bool = False  # the max_seqs shortest prompts (in their order), not the first ones


DEVICE = Budget(data_s=70, chimera_s=30, cerberus_s=15, gen_batch=512, chimera_batch=32, heads_batch=4096,
                epochs=8)
DRY_RUN = Budget(data_s=None, chimera_s=6, cerberus_s=4, gen_batch=16, chimera_batch=4, heads_batch=256, epochs=1,
                 max_seqs=12, heldout_fraction=0.3, shortest=True)


# --- 1. prepare (here) ----------------------------------------------------------------------------------------
def prepare(out: Path, model: str | None = None, max_seqs: int = 5120, reply_tokens: int = 256,
            max_len: int = 512, log=print) -> Path:
    """``train-prompts.npz``: the training prompts as ids and what the device needs beside them."""
    from specdeploy.exporter.export.base import model_config
    from specdeploy.exporter.source import check_architecture, load_model
    from specdeploy.exporter.train.cache import data_config
    from specdeploy.exporter.train.data import reply_token_counts
    from specdeploy.exporter.train.sharegpt import select_sequences
    from specdeploy.exporter.train.weights import load_draft_weights

    loaded = load_model(model)
    cfg = loaded.model.config
    if loaded.format != "gguf":
        raise TrainingError("Training on the device reads the base from its GGUF; name a GGUF model.")
    shipped = {k: load_draft_weights(WEIGHTS_DIR / f"{k}.safetensors", k).config for k in KINDS}
    taps = tuple(shipped[CHIMERA].feature_layers)
    config = data_config(max_seqs, max_len, 0, "self", reply_tokens, feature_layers=taps)
    conv_ids, ids = [], []
    for conv, prompt, _ in select_sequences(loaded.tokenizer, config):
        conv_ids.append(conv.id)
        ids.append(np.asarray(prompt, np.int64))
    vocab = int(cfg.vocab_size)
    counts = reply_token_counts(loaded.tokenizer, vocab, 3000, config.source)
    eos = model_config(loaded.model, loaded.tokenizer, check_architecture(cfg, loaded.path)).eos_token_ids
    flat = np.concatenate(ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.npz")
    np.savez_compressed(
        tmp, ids=flat.astype(np.uint16 if vocab <= 1 << 16 else np.int32),
        offsets=np.concatenate([[0], np.cumsum([len(p) for p in ids])]).astype(np.int64),
        conversation_ids=np.asarray(conv_ids), token_counts=counts, eos_token_ids=np.asarray(eos, np.int64),
        weight_sha=np.asarray(loaded.weight_sha), data_config=np.asarray(json.dumps(asdict(config))),
        drafts=np.asarray(json.dumps({k: asdict(c) for k, c in shipped.items()})),
        base=np.asarray(json.dumps({"hidden_size": int(cfg.hidden_size), "vocab_size": vocab})))
    if tmp.stat().st_size > PROMPTS_BOUND:
        tmp.unlink()
        raise TrainingError(f"{len(ids)} prompts make a prompts file over {PROMPTS_BOUND >> 20} MiB, too large to ride "
                            "with a GGUF part; lower --max-seqs.")
    tmp.replace(out)
    log(f"wrote {out} ({len(ids)} prompts, {flat.size} prompt tokens, {out.stat().st_size / 2**20:.1f} MiB)")
    return out


@dataclass
class Prepared:
    """``train-prompts.npz`` read back."""

    prompts: list[np.ndarray]
    conversation_ids: list[str]
    token_counts: np.ndarray
    eos_token_ids: tuple[int, ...]
    weight_sha: str
    data: dict[str, Any]
    drafts: dict[str, dict[str, Any]]
    base: dict[str, int]

    @classmethod
    def read(cls, path: Path) -> Prepared:
        try:
            with np.load(path) as f:
                offsets, ids = f["offsets"], f["ids"].astype(np.int64)
                return cls([ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)],
                           [str(c) for c in f["conversation_ids"]], f["token_counts"].astype(np.int64),
                           tuple(int(e) for e in f["eos_token_ids"]), str(f["weight_sha"]),
                           json.loads(str(f["data_config"])), json.loads(str(f["drafts"])),
                           json.loads(str(f["base"])))
        except (OSError, KeyError, ValueError) as exc:
            raise TrainingError(f"'{path}' is not a prepared prompts file ({type(exc).__name__}); make it with "
                                "'python -m specdeploy.exporter.train.ondevice prepare'.") from None


# --- 2. run (the device) ----------------------------------------------------------------------------------------
class _Base:
    """What the data pipeline and the trainers read from a loaded base model, from the GGUF's shape."""

    def __init__(self, shape):
        s = shape
        self.config = SimpleNamespace(
            hidden_size=s.hidden_size, vocab_size=s.vocab_size, num_hidden_layers=s.num_layers,
            num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
            intermediate_size=s.intermediate_size, rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta)

    def to(self, device):  # the pipeline moves its base back to the CPU at the end; nothing to move here
        return self


def _training_data(prep: Prepared, weights, shape, device: str, work: Path, budget: Budget, log):
    """The self-distilled cache, made by the torch backend on ``device`` (fp32, the Chimera's taps)."""
    from specdeploy.exporter.bench.gpu import synthetic_manifest
    from specdeploy.exporter.reference.torch_backend import TorchBackend
    from specdeploy.exporter.train.cache import DataConfig
    from specdeploy.exporter.train.data import build_cache
    from specdeploy.exporter.train.selfdistill import BatchGenerator
    from specdeploy.exporter.train.sharegpt import Conversation

    data = {**prep.data, "feature_layers": tuple(prep.data["feature_layers"])}
    count = min(len(prep.prompts), budget.max_seqs or len(prep.prompts))
    lengths = np.asarray([len(p) for p in prep.prompts])
    rows = np.sort(np.argsort(lengths, kind="stable")[:count]) if budget.shortest else np.arange(count)
    longest = int(lengths[rows].max()) + int(data["reply_tokens"]) + 4
    manifest = synthetic_manifest(shape, max_context=max(longest, 64), max_tree=4)
    where = "a CUDA GPU" if device.startswith("cuda") else "the CPU"
    loaded = SimpleNamespace(model=_Base(shape), tokenizer=None, weight_sha=prep.weight_sha, path="GGUF on the device")
    sequences = ((Conversation(prep.conversation_ids[i], ()), prep.prompts[i], np.zeros(0, np.uint8)) for i in rows)
    # closed once the data is made: training then has the device to itself
    with TorchBackend("", manifest, device=device, precision="fp32", cuda_graphs=False, weights=weights,
                      shape=shape, feature_layers=data["feature_layers"]) as backend:
        gen = BatchGenerator(backend, prep.eos_token_ids, f"torch fp32 on {where}, GGUF {prep.weight_sha[:12]}")
        config = replace(DataConfig(**data), max_seqs=count, shard_size=budget.gen_batch, engine=gen.description,
                         replies_file=None, heldout_fraction=budget.heldout_fraction or data["heldout_fraction"])
        cache = build_cache(loaded, work / "data", config, device=device, generator=gen, time_limit_s=budget.data_s,
                            keep_partial=True, sequences=sequences, show_progress=sys.stderr.isatty())
    if cache is None:
        raise TrainingError("The data's time limit came before its first shard was made.")
    np.save(cache.path / "token_counts.npy", prep.token_counts)  # the draft vocabulary's order needs no tokenizer
    log(f"training data: {cache.num_sequences} sequences, {cache.num_tokens} tokens, "
        f"{int(cache.assistant.sum())} reply positions")
    return cache


def _train_kind(kind: str, cache, weights, shape, prep: Prepared, device: str, work: Path, budget: Budget,
                log) -> dict[str, Any]:
    """One draft of the shipped one's shape, trained on ``cache`` under its time limit; its summary."""
    from specdeploy.exporter.train.compact import compact_draft_weights
    from specdeploy.exporter.train.data import vocab_order
    from specdeploy.exporter.train.weights import LoopConfig, train

    order = vocab_order(cache, None)
    lm = weights["lm_head_t"].t()
    shipped = prep.drafts[kind]
    if kind == CHIMERA:
        from specdeploy.exporter.train.chimera import ChimeraTask, ChimeraTrainConfig
        from specdeploy.exporter.train.options import CHIMERA_DEFAULTS

        cfg = ChimeraTrainConfig(num_heads=int(shipped["num_heads"]), vocab_trim=CHIMERA_DEFAULTS.vocab_trim,
                                 feature_layers=tuple(shipped["feature_layers"]))
        task = ChimeraTask(cache, weights["embed_tokens"], lm, weights["final_norm"], _Base(shape).config,
                           prep.weight_sha, cfg, order)
        loop = LoopConfig(epochs=budget.epochs, batch_size=budget.chimera_batch, lr=CHIMERA_DEFAULTS.lr,
                          device=device, time_limit_s=budget.chimera_s, warmup_steps=20, ckpt_every=10**9)
    else:
        from specdeploy.exporter.train.heads import HeadsTask, HeadsTrainConfig
        from specdeploy.exporter.train.options import HEADS_DEFAULTS

        cfg = HeadsTrainConfig(kind, num_heads=int(shipped["num_heads"]), layers=int(shipped["layers"]),
                               vocab_trim=8192)
        task = HeadsTask(cache, lm, prep.weight_sha, cfg, order)
        loop = LoopConfig(epochs=budget.epochs, batch_size=budget.heads_batch, lr=HEADS_DEFAULTS.lr, device=device,
                          time_limit_s=budget.cerberus_s, ckpt_every=10**9)
    path = work / f"{kind}.safetensors"
    result = train(task, path, loop, resume="restart", show_progress=False, log=log)
    compact = work / "compact" / path.name  # int8 rows with an fp16 scale each, as the shipped drafts are stored
    compact.parent.mkdir(exist_ok=True)
    compact_draft_weights(path, compact)
    return {"file": compact, "steps": result.steps, "train_seconds": round(result.seconds, 1),
            "positions_seen": int(result.steps * loop.batch_size * (1 if kind != CHIMERA else
                                                                     cache.num_tokens / cache.num_sequences)),
            "final": result.final, "bytes": compact.stat().st_size}


def run(out_dir: Path, gguf: Path, prompts: Path, dry_run: bool = False, budget: Budget | None = None,
        log=print):
    """The device's run: data, then Chimera and Cerberus; ``train.json`` and the two weight files in ``out_dir``.
    Returns the report (its ``failed`` stages decide the exit code)."""
    import platform

    import torch
    from specdeploy.exporter.bench.gpu_common import Report
    from specdeploy.exporter.bench.gpu_real import read_gguf
    from specdeploy.exporter.source import file_sha

    budget = budget or (DRY_RUN if dry_run else DEVICE)
    cuda = torch.cuda.is_available() and not dry_run
    if not dry_run and not cuda:
        raise TrainingError("Training on the device needs a CUDA GPU and PyTorch sees none; pass --dry-run to run "
                            "it on the CPU.")
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the labels are the fp32 model's
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = Report(out_dir / "train.json", {"dry_run": dry_run, "device": device, "torch": torch.__version__,
                                          "device_name": torch.cuda.get_device_name(0) if cuda else
                                          platform.processor(), "budget": asdict(budget)})
    cache = None
    with tempfile.TemporaryDirectory(prefix="specdeploy-ondevice-") as tmp:
        work = Path(tmp)
        with rep.stage("load") as res:
            prep = Prepared.read(prompts)
            if not gguf.is_file():
                raise TrainingError(f"There is no GGUF at '{gguf}': send it first (gpu_transfer.py).")
            if file_sha(gguf) != prep.weight_sha:
                raise TrainingError(f"The GGUF '{gguf.name}' is not the model the prompts were prepared for.")
            weights, shape = read_gguf(gguf)
            if (shape.hidden_size, shape.vocab_size) != (prep.base["hidden_size"], prep.base["vocab_size"]):
                raise TrainingError("The GGUF's shape differs from the prepared base's.")
            res.update({"prompts": len(prep.prompts), "feature_layers": prep.data["feature_layers"]})
        if rep.ready("data", ("load",)):
            with rep.stage("data") as res:
                t0 = time.time()
                cache = _training_data(prep, weights, shape, device, work, budget, log)
                positions = int(cache.assistant.sum())
                res.update({"sequences": cache.num_sequences, "tokens": cache.num_tokens,
                            "reply_positions": positions, "of_prompts": len(prep.prompts),
                            "heldout_sequences": int(cache.heldout.sum()), "seconds": round(time.time() - t0, 1),
                            "engine": cache.meta.get("engine")})
        for kind in KINDS:
            if not rep.ready(kind, ("data",)):
                continue
            with rep.stage(kind) as res:
                summary = _train_kind(kind, cache, weights, shape, prep, device, work, budget, log)
                if summary["bytes"] > MAX_FILE_BYTES:
                    raise TrainingError(f"{kind}.safetensors is {summary['bytes'] / 2**20:.1f} MiB, over the "
                                        f"{MAX_FILE_BYTES >> 20} MiB a file may weigh on its way back.")
                shutil.copyfile(summary.pop("file"), out_dir / f"{kind}.safetensors")
                res.update(summary)
    return rep


# --- 3. keep (here) ---------------------------------------------------------------------------------------------
def _plain(bundle: Path, prompts: list[str], tokens: int, threads: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, plain greedy reply) per prompt: the reference every draft's output must equal."""
    from specdeploy.runtime import load
    from specdeploy.runtime.decode import GenerationConfig

    with load(bundle, draft=None, threads=threads) as plain:
        ids = [plain.encode(p, chat=True) for p in prompts]
        return [(i, plain.generate_ids(i, GenerationConfig(tokens))) for i in ids]


def _tau(bundle: Path, kind: str, refs: list[tuple[list[int], list[int]]], tokens: int,
         threads: int) -> dict[str, Any]:
    """Tokens per verify step of ``kind``'s draft in ``bundle``, drafting every step, on this CPU's plan; each
    output checked against plain decoding (``refs``)."""
    from specdeploy.runtime import load
    from specdeploy.runtime.decode import DecodeStats, GenerationConfig

    draft = CERBERUS_NOGATE if kind == CERBERUS else kind  # the gate would decline: acceptance, not the rule
    made = steps = 0
    with load(bundle, draft=draft, threads=threads, tree=KEEP_TREE) as eng:
        eng.decoder.drafter.always_model = True
        for i, ref in refs:
            st = DecodeStats()
            if eng.generate_ids(i, GenerationConfig(tokens), st) != ref:
                raise TrainingError(f"The {kind} draft in '{bundle}' changed the output: the runtime is not exact "
                                    "here; nothing is kept.")
            made += st.new_tokens - 1 - st.gate_ar
            steps += st.gate_parallel
        plan = eng.plan.reason
    return {"tau": round(made / max(1, steps), 4), "steps": steps, "plan": plan}


def keep(new_dir: Path, bundle: Path, out: Path, dest: Path = WEIGHTS_DIR, num_prompts: int = 24,
         tokens: int = 64, threads: int = 2, calibrate: dict[str, Any] | None = None, log=print) -> dict[str, Any]:
    """Each new draft in ``new_dir`` against the one in ``dest``, tau on MT-bench prompts on this CPU; a new one
    that accepts more replaces it (weights, then its calibration for this machine). ``out``: ``keep.json`` (and
    ``keep.png`` beside it)."""
    from specdeploy.exporter.bench.promptsets import mt_bench
    from specdeploy.exporter.export.draft import export_draft
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters import kinds

    read_manifest(bundle)  # a wrong path or a corrupt bundle: one sentence, before any work
    found = [k for k in KINDS if (new_dir / f"{k}.safetensors").is_file()]
    if not found:
        raise TrainingError(f"'{new_dir}' holds no chimera.safetensors or cerberus.safetensors to weigh.")
    prompts = [item.text for item in mt_bench(num_prompts)]
    refs = _plain(bundle, prompts, tokens, threads)  # the base is the same in every copy below
    result: dict[str, Any] = {"bundle": str(bundle), "prompts": f"MT-bench first turns x {len(prompts)}",
                              "max_new_tokens": tokens, "kinds": {}}
    with tempfile.TemporaryDirectory(prefix="specdeploy-keep-") as tmp:
        work = Path(tmp)
        for kind in found:
            new, shipped = new_dir / f"{kind}.safetensors", dest / f"{kind}.safetensors"
            copy = work / kind  # one copy of the bundle; the new draft replaces the shipped one in it
            shutil.copytree(bundle, copy, symlinks=True)
            taus = {}
            for side, weights in (("shipped", shipped), ("new", new)):
                export_draft(copy, kind, weights, progress=lambda m: None)
                taus[side] = _tau(copy, kind, refs, tokens, threads)
                log(f"{kind} {side}: tau {taus[side]['tau']} ({taus[side]['plan']})")
            better = taus["new"]["tau"] > taus["shipped"]["tau"]
            entry = result["kinds"][kind] = {**{f"{s}_tau": t["tau"] for s, t in taus.items()}, "kept": better,
                                             "plan": taus["new"]["plan"]}
            if better:  # staged, calibrated for this machine, then both files replace the shipped ones
                staged = work / f"staged-{kind}" / f"{kind}.safetensors"
                staged.parent.mkdir()
                shutil.copyfile(new, staged)
                kinds.resolve(kinds.describe(kind).calibrator)(copy, kind, staged, threads=threads,
                                                               **(calibrate or {}))
                for f in staged.parent.iterdir():
                    shutil.copyfile(f, dest / f.name)
                entry["replaced"] = str(shipped)
            log(f"{kind}: {'the new draft replaces' if better else 'kept'} the shipped one "
                f"(tau {taus['new']['tau']} new against {taus['shipped']['tau']})")
            _write(out, result)
    return result


def _write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["kinds"])
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 3.2))
    x = np.arange(len(names))
    for i, side in enumerate(("shipped", "new")):
        ax.bar(x + (i - 0.5) * 0.38, [result["kinds"][k][f"{side}_tau"] for k in names], 0.38, label=side)
    ax.set_xticks(x, names)
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title(f"drafting every step, {result['prompts']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


# --- CLI --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specdeploy.exporter.train.ondevice", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="the training prompts as ids (here)")
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--max-seqs", type=int, default=5120)
    p.add_argument("--reply-tokens", type=int, default=256)
    r = sub.add_parser("run", help="data and training (the device; --dry-run: the CPU)")
    r.add_argument("out_dir", type=Path)
    r.add_argument("--gguf", type=Path, required=True)
    r.add_argument("--prompts", type=Path, required=True)
    r.add_argument("--dry-run", action="store_true")
    k = sub.add_parser("keep", help="new drafts against the shipped ones (here)")
    k.add_argument("new_dir", type=Path)
    k.add_argument("bundle", type=Path)
    k.add_argument("--json", type=Path, default=Path("keep.json"))
    k.add_argument("--num-prompts", type=int, default=24)
    k.add_argument("--max-new-tokens", type=int, default=64)
    k.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        if args.cmd == "prepare":
            prepare(args.out, args.model, args.max_seqs, args.reply_tokens, log=say)
        elif args.cmd == "run":
            rep = run(args.out_dir, args.gguf, args.prompts, args.dry_run, log=say)
            failed = rep.failed
            say(f"wrote {args.out_dir / 'train.json'}: " + (f"FAILED {', '.join(failed)}" if failed else "passed"))
            sys.exit(1 if failed else 0)
        else:
            keep(args.new_dir, args.bundle, args.json, num_prompts=args.num_prompts, tokens=args.max_new_tokens,
                 threads=args.threads, log=say)
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
