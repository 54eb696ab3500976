"""Self-distillation data through the runtime: batched greedy replies, hidden states and labels in one pass.

A draft learns to predict what the deployed model will say next, from the hidden states the runtime
will hand it. So the data comes from the runtime itself: a bundle's base graph on ONNX Runtime. It is
the bundle's standard-op graph (``trt`` target), which takes any batch: the fused ``ort`` graph's
attention kernel (``GroupQueryAttention``) runs one sequence at a time once a cache holds a past,
and that graph pads every step to at least two rows.

One pass over a batch of prompts (left-padded, each row with its own positions and mask, one cache)
yields, per sequence, the three things training reads:

* the reply: greedy tokens until the end-of-turn token or ``max_new_tokens``;
* the base's last hidden state at every position (prompt and reply), stored fp16;
* the base's greedy label at every position that predicts a reply token, which for greedy decoding is
  the next token itself (and the next token elsewhere, where no loss reads it).

Rows that finish leave the batch (their cache rows are dropped), so a short reply costs no more steps.
Reply token ids are small (4 bytes a token): :func:`save_replies` writes them so that a later run
(``--replies-file``: :meth:`RuntimeGenerator.features`, or the torch engine's pass) re-derives the
features, teacher-forced, without generating again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from specdeploy.runtime.errors import TrainingError


@dataclass
class Sequenced:
    """One training sequence: prompt + reply ids, its reply mask, fp16 hidden states and labels."""

    ids: np.ndarray  # [N] int32
    mask: np.ndarray  # [N] uint8, 1 on reply tokens
    hidden: np.ndarray  # [N, H] fp16
    labels: np.ndarray  # [N] int32
    layers: np.ndarray | None = None  # [N, taps*H] fp16: a graph with feature_layers only


def fp16_states(x: np.ndarray) -> np.ndarray:
    """Residual states in fp16, kept finite: mid layers carry rare outliers (SmolLM2: |x| ~ 2e4)."""
    return np.clip(x, -65504.0, 65504.0).astype(np.float16)


def shard_arrays(seqs: Sequence[Sequenced]) -> dict[str, np.ndarray]:
    """A cache shard's arrays from :class:`Sequenced` sequences."""
    layers = {"layers": np.concatenate([q.layers for q in seqs])} if seqs and seqs[0].layers is not None else {}
    return {
        **layers,
        "tokens": np.concatenate([q.ids for q in seqs]).astype(np.int32),
        "assistant": np.concatenate([q.mask for q in seqs]).astype(np.uint8),
        "hidden": np.concatenate([q.hidden for q in seqs]).astype(np.float16),
        "labels": np.concatenate([q.labels for q in seqs]).astype(np.int32),
        "lengths": np.asarray([len(q.ids) for q in seqs], dtype=np.int64),
    }


class BatchGenerator:
    """A base step backend that takes any batch, driven in batches with one cache per batch: what
    :class:`RuntimeGenerator` (ONNX Runtime) and the GPU's torch engine (:mod:`.ondevice`) share.
    ``description`` names the engine in the cache's identity."""

    def __init__(self, backend, eos_token_ids, description: str):
        self.backend, self.description = backend, description
        self._neg = np.finfo(self.backend.mask_dtype).min
        self.eos = frozenset(int(e) for e in eos_token_ids)

    # --- one batch ----------------------------------------------------------------------------------
    def _step(self, cache, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, write: np.ndarray,
              logits_rows: np.ndarray):
        from specdeploy.runtime.backends.base import StepInputs

        return self.backend.step(StepInputs(ids.astype(np.int64), pos.astype(np.int64), mask,
                                            write.astype(np.int64), logits_rows.astype(np.int64)), cache)

    def _prefill(self, prompts: Sequence[np.ndarray], capacity: int):
        """Left-padded prefill: row r's prompt sits at slots ``width - len(r) .. width - 1``."""
        b, width = len(prompts), max(len(p) for p in prompts)
        cache = self.backend.new_cache(b, capacity)
        ids = np.zeros((b, width), dtype=np.int64)
        pos = np.zeros((b, width), dtype=np.int64)
        mask = np.full((b, 1, width, capacity), self._neg, dtype=self.backend.mask_dtype)
        causal = np.tril(np.ones((width, width), dtype=bool))
        for r, p in enumerate(prompts):
            off = width - len(p)
            ids[r, off:] = p
            pos[r, off:] = np.arange(len(p))
            seen = causal.copy()
            seen[:, :off] = False
            seen[np.arange(off), np.arange(off)] = True  # padding rows see themselves (their output is unused)
            mask[r, 0, :, :width] = np.where(seen, 0.0, self._neg)
        out = self._step(cache, ids, pos, mask, np.arange(width), np.array([width - 1]))
        return cache, out, width

    def generate(self, prompts: Sequence[np.ndarray], max_new_tokens: int, min_tokens: int = 1) -> list[Sequenced]:
        """Greedy replies to ``prompts`` with every position's hidden state and label, in one pass.

        Each reply token is fed once (the last one too), which gives its hidden state and the base's
        prediction after it. A reply shorter than ``min_tokens`` gets an all-zero mask (no training
        position).
        """
        if not prompts:
            return []
        lengths = np.array([len(p) for p in prompts])
        capacity = int(lengths.max()) + max_new_tokens + 2  # +1: a graph may write a dummy slot after a row
        cache, out, width = self._prefill(prompts, capacity)
        hidden: list[list[np.ndarray]] = [[out.hidden_states[r, width - n :]] for r, n in enumerate(lengths)]
        taps = out.layer_states is not None
        layers: list[list[np.ndarray]] = [[out.layer_states[r, width - n :]] if taps else [] for r, n in
                                          enumerate(lengths)]
        replies: list[list[int]] = [[] for _ in prompts]
        after = np.zeros(len(prompts), dtype=np.int64)  # the base's prediction after each reply's last token
        rows = np.arange(len(prompts))  # the prompts still generating, in cache row order
        reach = np.zeros((len(prompts), capacity), dtype=bool)  # per cache row, the slots it attends
        for r, n in enumerate(lengths):
            reach[r, width - n : width] = True
        nxt = _greedy(out)
        for t in range(max_new_tokens):
            slot = width + t
            reach[:, slot] = True
            mask = np.where(reach[:, None, None, :], 0.0, self._neg).astype(self.backend.mask_dtype)
            step = self._step(cache, nxt.reshape(-1, 1), (lengths[rows] + t).reshape(-1, 1), mask,
                              np.array([slot]), np.array([0]))
            done = np.array([int(x) in self.eos for x in nxt]) | (t == max_new_tokens - 1)
            for i, r in enumerate(rows):
                replies[r].append(int(nxt[i]))
                hidden[r].append(step.hidden_states[i])
                if taps:
                    layers[r].append(step.layer_states[i])
            nxt = _greedy(step)
            after[rows[done]] = nxt[done]
            if done.all():
                break
            if done.any():  # finished rows leave the batch
                live = np.flatnonzero(~done)
                cache = _keep_rows(self.backend, cache, live)
                reach, rows, nxt = reach[live], rows[live], nxt[live]
        return [_sequence(p, replies[r], hidden[r], int(after[r]), min_tokens, layers[r] if taps else None)
                for r, p in enumerate(prompts)]

    def features(self, seqs: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Sequenced]:
        """Teacher-forced: hidden states and the base's greedy labels for given ``(ids, reply mask)``.

        One prefill per sequence (a prefill is already many rows); the labels of the rows that predict a
        reply token (the last prompt token's on) are the argmax of their logits, the others the next token.
        """
        out = []
        for ids, mask in seqs:
            n = len(ids)
            cache = self.backend.new_cache(1, n + 2)
            causal = np.where(np.tril(np.ones((n, n), dtype=bool)), 0.0, self._neg)
            attn = np.full((1, 1, n, n + 2), self._neg, dtype=self.backend.mask_dtype)
            attn[0, 0, :, :n] = causal
            first = max(0, int(np.argmax(mask)) - 1) if mask.any() else n - 1  # the last prompt token
            rows = np.arange(first, n)
            step = self._step(cache, np.asarray(ids)[None], np.arange(n)[None], attn, np.arange(n), rows)
            labels = np.append(np.asarray(ids[1:], dtype=np.int32), 0)
            labels[rows] = step.argmax[0] if step.argmax is not None else step.logits[0].argmax(-1)
            out.append(Sequenced(np.asarray(ids, np.int32), np.asarray(mask, np.uint8),
                                 step.hidden_states[0].astype(np.float16), labels.astype(np.int32),
                                 None if step.layer_states is None else fp16_states(step.layer_states[0])))
        return out


class RuntimeGenerator(BatchGenerator):
    """The bundle's standard-op base graph on ONNX Runtime."""

    def __init__(self, bundle: str | os.PathLike, threads: int | None = None):
        from specdeploy.runtime.backends.ort import OrtBackend
        from specdeploy.runtime.bundle import read_manifest

        self.bundle = Path(bundle)
        self.manifest = read_manifest(self.bundle)
        graph = self.manifest.find_graph("base", "trt")
        if graph is None:
            raise TrainingError(
                f"The bundle '{self.bundle}' has no standard-op base graph, which batched generation needs "
                "(ONNX Runtime's fused attention takes one sequence at a time); export one with --target all or trt."
            )
        self.graph = graph
        super().__init__(OrtBackend(self.bundle, self.manifest, threads=threads, graph=graph),
                         self.manifest.model.eos_token_ids, f"{graph.file} ({graph.precision}) {graph.sha[:12]}")

    def check_base(self, weight_sha: str) -> None:
        if self.manifest.source.weight_sha != weight_sha:
            raise TrainingError(
                f"The bundle '{self.bundle}' was exported from another base model than the one being trained for."
            )


def _greedy(step) -> np.ndarray:
    """Each row's greedy next token after a one-logits-row step (the backend's argmax where it has one)."""
    return np.asarray(step.argmax[:, 0]) if step.argmax is not None else np.asarray(step.logits[:, 0]).argmax(-1)


def _keep_rows(backend, cache, rows: np.ndarray):
    """A cache holding only ``rows`` of ``cache`` (same capacity, same length)."""
    new = backend.new_cache(len(rows), cache.capacity)
    for dst, src in zip(new.buffers(), cache.buffers()):
        dst[...] = src[rows]
    new.length = cache.length
    return new


def _sequence(prompt: np.ndarray, reply: list[int], hidden: list[np.ndarray], after: int,
              min_tokens: int, layers: list[np.ndarray] | None = None) -> Sequenced:
    ids = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(reply, dtype=np.int32)])
    h = np.concatenate(hidden).astype(np.float16)
    labels = np.append(ids[1:], after).astype(np.int32)  # greedy: the label is the next token
    taps = None if layers is None else fp16_states(np.concatenate(layers))
    return Sequenced(ids, reply_mask(len(prompt), len(reply), min_tokens), h, labels, taps)


def reply_mask(prompt_len: int, reply_len: int, min_tokens: int) -> np.ndarray:
    """1 on the reply's tokens; all 0 for a reply shorter than ``min_tokens`` (no training position)."""
    ones = 1 if reply_len >= min_tokens else 0
    return np.concatenate([np.zeros(prompt_len, np.uint8), np.full(reply_len, ones, np.uint8)])


# --- reply ids, kept -------------------------------------------------------------------------------------
def save_replies(path: Path, conversation_ids: list[str], replies: list[np.ndarray] | None,
                 base_weight_sha: str | None = None) -> None:
    """The reply token ids of a self-reply cache, by conversation id: small enough to commit (uint16 when
    every id fits, else int32; compressed), with the weight hash of the model that wrote them (which
    ``export draft --kind ngram`` checks)."""
    if replies is None:
        return
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in replies])]).astype(np.int64)
    ids = np.concatenate(replies).astype(np.int64) if replies else np.zeros(0, np.int64)
    ids = ids.astype(np.uint16 if ids.size == 0 or (ids.min() >= 0 and ids.max() < 1 << 16) else np.int32)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    made_by = {} if base_weight_sha is None else {"base_weight_sha": np.asarray(base_weight_sha)}
    np.savez_compressed(tmp, conversation_ids=np.asarray(conversation_ids), offsets=offsets, ids=ids, **made_by)
    os.replace(tmp, path)


def load_replies(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{conversation id: reply ids}`` from :func:`save_replies`; a bad file gets one sentence."""
    try:
        with np.load(path) as f:
            cids, offsets, ids = f["conversation_ids"], f["offsets"], f["ids"]
    except (OSError, KeyError, ValueError) as exc:
        raise TrainingError(f"'{path}' is not a replies file ({type(exc).__name__}).") from None
    ids = ids.astype(np.int32)
    return {str(c): ids[offsets[i] : offsets[i + 1]] for i, c in enumerate(cids)}


def with_reply(prompt: np.ndarray, known: dict[str, np.ndarray], conversation_id: str,
                min_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    reply = known.get(conversation_id)
    if reply is None:
        raise TrainingError(f"The replies file has no reply for conversation {conversation_id}; "
                            "make it with the same data settings.")
    return np.concatenate([prompt, reply]).astype(np.int32), reply_mask(len(prompt), len(reply), min_tokens)


def replies_of(shards: Path, num_shards: int) -> list[np.ndarray] | None:
    """Each sequence's reply ids (what follows its prompt), from the shards; None for shards of old runs."""
    replies = []
    for i in range(num_shards):
        d = shards / f"{i:05d}"
        if not (d / "prompt_lengths.npy").is_file():
            return None
        tokens, lengths = np.load(d / "tokens.npy"), np.load(d / "lengths.npy")
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for j, n in enumerate(np.load(d / "prompt_lengths.npy")):
            replies.append(tokens[starts[j] + n : starts[j + 1]])
    return replies
