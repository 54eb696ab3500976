"""``specdeploy export draft --kind ngram``: the base model's own n-gram table, from its replies.

The replies file is the data engine's (``specdeploy train data``; the embedded model's 5,120 greedy
replies to ShareGPT first turns are ``graphs/weights/self-replies.npz``). For each context order
k = 1..4 the table keeps every k-token context seen in the replies with the token that most often
followed it; ties go to the smaller id, so the table is a pure function of the file. Each entry also
gets a calibration cell, (order, count bucket, share tenth), whose hit rate is measured on held-out
replies (every 16th) against a table built from the others: the runtime sizes its chains from those
rates (``runtime/drafters/ngram.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from specdeploy.runtime.bundle import DraftEntry, config_pairs, hash_files, read_manifest, write_manifest
from specdeploy.runtime.drafters.kinds import NGRAM
from specdeploy.runtime.drafters.ngram import (
    COUNT_EDGES,
    MAX_ORDER,
    SHARE_BINS,
    TABLE_FILE,
    NgramTable,
    cell,
    token_bits,
)
from specdeploy.runtime.drafters.ngram import max_order as longest_order
from specdeploy.runtime.errors import DraftMismatchError

HELDOUT_EVERY = 16  # every 16th reply calibrates the hit rates
PRIOR_WEIGHT = 4.0  # pseudo-observations at the order's mean hit rate, for sparse cells


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_replies(path: str | Path, vocab_size: int, base_weight_sha: str) -> list[np.ndarray]:
    """The replies of a replies file, checked against the bundle's base model (one sentence otherwise)."""
    try:
        with np.load(path) as z:
            offsets, ids = z["offsets"].astype(np.int64), z["ids"].astype(np.int64)
            made_by = str(z["base_weight_sha"]) if "base_weight_sha" in z.files else None
    except (OSError, KeyError, ValueError) as exc:
        raise DraftMismatchError(f"Cannot read the replies file '{path}' ({type(exc).__name__}).") from None
    if made_by is not None and made_by != base_weight_sha:
        raise DraftMismatchError(f"The replies in '{path}' were made by another model than the bundle's base.")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise DraftMismatchError(f"The replies in '{path}' hold token ids outside the bundle's vocabulary.")
    if offsets.size < 2 or offsets[0] != 0 or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0):
        raise DraftMismatchError(f"'{path}' is not a replies file (its offsets do not match its ids).")
    return [ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def count_order(replies: list[np.ndarray], order: int, bits: int = 16
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every context of ``order`` tokens in the replies: packed key (``bits`` per id, sorted), most
    frequent next token, its count, and the context's count."""
    keys, nexts = [], []
    for seq in replies:
        if len(seq) <= order:
            continue
        key = np.zeros(len(seq) - order, dtype=np.uint64)
        for j in range(order):
            key = (key << np.uint64(bits)) | seq[j : len(seq) - order + j].astype(np.uint64)
        keys.append(key)
        nexts.append(seq[order:])
    if not keys:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(0, dtype=np.uint64), empty, empty, empty
    key, nxt = np.concatenate(keys), np.concatenate(nexts)
    by = np.lexsort((nxt, key))
    key, nxt = key[by], nxt[by]
    pair_start = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])])
    pair_count = np.diff(np.r_[pair_start, len(key)])
    pkey, pnext = key[pair_start], nxt[pair_start]
    # Per context, the pair with the highest count (the smaller id on ties): sort by (key, -count, id).
    by = np.lexsort((pnext, -pair_count, pkey))
    pkey, pnext, pair_count = pkey[by], pnext[by], pair_count[by]
    group = np.flatnonzero(np.r_[True, pkey[1:] != pkey[:-1]])
    total = np.add.reduceat(pair_count, group)
    return pkey[group], pnext[group], pair_count[group], total


def build_table(replies: list[np.ndarray], vocab_size: int, max_order: int = MAX_ORDER,
                hit_rate: np.ndarray | None = None) -> NgramTable:
    keys, tokens, cells = [], [], []
    for k in range(1, max_order + 1):
        key, nxt, top, total = count_order(replies, k, token_bits(vocab_size))
        keys.append(key)
        tokens.append(nxt)
        cells.append(cell(np.full(len(key), k), total, top / np.maximum(total, 1)))
    cells_total = max_order * (len(COUNT_EDGES) + 1) * SHARE_BINS
    rate = np.full(cells_total, 0.5) if hit_rate is None else hit_rate
    return NgramTable(keys, tokens, cells, rate, vocab_size)


def calibrate(replies: list[np.ndarray], vocab_size: int, max_order: int = MAX_ORDER) -> tuple[np.ndarray, dict]:
    """Hit rate per calibration cell: a table of the other replies predicts every held-out position."""
    held = replies[::HELDOUT_EVERY]
    train = [r for i, r in enumerate(replies) if i % HELDOUT_EVERY]
    table = build_table(train, vocab_size, max_order)
    n_cells = len(table.hit_rate)
    hits, seen = np.zeros(n_cells), np.zeros(n_cells)
    predicted = positions = 0
    for seq in held:
        seq = seq.tolist()
        for i in range(len(seq) - 1):
            tok, where, _ = table.predict(seq[max(0, i + 1 - max_order) : i + 1])
            positions += 1
            if tok < 0:
                continue
            predicted += 1
            seen[where] += 1
            hits[where] += tok == seq[i + 1]
    per_order = (len(COUNT_EDGES) + 1) * SHARE_BINS
    rate = np.empty(n_cells)
    for k in range(max_order):
        part = slice(k * per_order, (k + 1) * per_order)
        mean = (hits[part].sum() + 1.0) / (seen[part].sum() + 2.0)
        rate[part] = (hits[part] + PRIOR_WEIGHT * mean) / (seen[part] + PRIOR_WEIGHT)
    stats = {"heldout_positions": positions, "heldout_predicted": predicted,
             "heldout_top1": round(float(hits.sum()) / max(positions, 1), 4)}
    return rate, stats


def export_ngram(bundle: str | Path, replies_path: str | Path, max_order: int = MAX_ORDER,
                 progress: Callable[[str], None] = _stderr) -> DraftEntry:
    """Add the n-gram table of ``replies_path`` to ``bundle`` (replacing an earlier one), atomically."""
    from specdeploy.exporter.export.staging import updated_bundle

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    max_order = min(max_order, longest_order(manifest.model.vocab_size))  # 3 for 18-bit ids (Qwen)
    replies = read_replies(replies_path, manifest.model.vocab_size, manifest.source.weight_sha)
    positions = int(sum(len(r) for r in replies))
    progress(f"[1/3] calibrating on held-out replies (1 in {HELDOUT_EVERY} of {len(replies)}, {positions} tokens) ...")
    rate, stats = calibrate(replies, manifest.model.vocab_size, max_order)
    progress(f"[2/3] counting {max_order} context orders over all replies ...")
    table = build_table(replies, manifest.model.vocab_size, max_order, rate)
    with updated_bundle(bundle) as tmp:
        np.savez(tmp / TABLE_FILE, **table.arrays())
        settings = {"table": TABLE_FILE, "max_order": max_order, "replies": len(replies), "reply_tokens": positions,
                    "contexts": [len(k) for k in table.keys], **stats}
        entry = DraftEntry(NGRAM, manifest.source.weight_sha, hash_files([tmp / TABLE_FILE]), (), config_pairs(settings))
        drafts = tuple(d for d in manifest.drafts if d.kind != NGRAM) + (entry,)
        write_manifest(tmp, manifest.replace(drafts=drafts))
        progress(f"[3/3] added {TABLE_FILE} to {bundle} ({sum(len(k) for k in table.keys)} contexts, "
                 f"held-out top-1 {stats['heldout_top1']})")
    return entry


def build_ngram(bundle: str | Path, kind: str, draft: str | Path, progress: Callable[[str], None] = _stderr,
                **_options) -> DraftEntry:
    """The ngram kind's builder, with the signature every ``DraftKind.builder`` has: the table of the replies
    ``draft`` (the trained drafts' options do not apply)."""
    return export_ngram(bundle, draft, progress=progress)
