"""N-gram drafting: prompt lookup, plus the base model's own n-gram statistics from its replies.

A 135M model's greedy replies repeat their phrasing from one answer to the next ("Here are some
tips for ...", "I hope this helps"). The table (``ngram.npz`` in a bundle, made by ``specdeploy
export draft --kind ngram`` from the model's own replies) holds, for every context of 1..K tokens
seen there, the token that most often followed it, with its share and count. A chain drafts by
backing off from the longest context the table knows. Each drafted token's chance of acceptance is
the hit rate measured on held-out replies for its (context order, count, share) cell, scaled online
by what this sequence's drafts have earned, so the chain's length is the one with the most expected
tokens per unit of step cost (the backend's measured curve), as prompt lookup sizes its matches.

Each step runs one of the two sources: prompt lookup's match (sized as in
:class:`PromptLookupDrafter`) or the table's chain, whichever is worth more, or a plain step when
neither pays. Verification keeps greedy output identical to plain decoding whatever is drafted.
The lookup costs a few microseconds per drafted token (binary search over sorted packed keys).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bundle import BundleManifest, hash_files
from ..errors import BundleError, DraftMismatchError
from ..tree import DraftTree
from .base import DraftContext
from .kinds import NGRAM
from .prompt_lookup import PromptLookupDrafter

TABLE_FILE = "ngram.npz"
TOKEN_BITS = 16  # ids pack 16 bits each into a uint64 key: vocabularies up to 65,536, orders up to 4
MAX_ORDER = 64 // TOKEN_BITS  # with a larger vocabulary each id takes more bits, and fewer fit a key
COUNT_EDGES = np.array([2, 4, 16])  # count buckets: 1, 2-3, 4-15, 16+
SHARE_BINS = 10  # share of the top next token, in tenths
TABLE_SOURCE = -1  # :meth:`NgramDrafter.chain`'s "n-gram size" of a chain that came from the table
MAX_CHANCE = 0.99  # no drafted token is taken as certain
CHAIN_FLOOR = 0.02  # a table chain stops where the chance that all of it is accepted falls below this


def token_bits(vocab_size: int) -> int:
    """Bits per id in a packed key: 16, or as many as the vocabulary needs (18 for Qwen's 151,936)."""
    return max(TOKEN_BITS, int(vocab_size - 1).bit_length())


def max_order(vocab_size: int) -> int:
    """The longest context whose ids fit one uint64 key (4 for 16-bit ids, 3 for 18-bit ones)."""
    return 64 // token_bits(vocab_size)


def pack(tokens, bits: int = TOKEN_BITS) -> int:
    """The uint64 key of a context of at most ``64 // bits`` token ids (each < 2**bits), oldest first."""
    key = 0
    for tok in tokens:
        key = (key << bits) | int(tok)
    return key


def cell(order: np.ndarray, count: np.ndarray, share: np.ndarray) -> np.ndarray:
    """Index of each prediction's calibration cell: (order 1..K, count bucket, share tenth)."""
    share_bin = np.minimum((np.asarray(share, dtype=np.float64) * SHARE_BINS).astype(np.int64), SHARE_BINS - 1)
    count_bin = np.searchsorted(COUNT_EDGES, np.asarray(count), side="right")
    return ((np.asarray(order) - 1) * (len(COUNT_EDGES) + 1) + count_bin) * SHARE_BINS + share_bin


class NgramTable:
    """Per context order k = 1..K: sorted packed keys, the most frequent next token, and the cell of
    its calibrated hit rate (``hit_rate[cell]``)."""

    def __init__(self, keys: list[np.ndarray], tokens: list[np.ndarray], cells: list[np.ndarray],
                 hit_rate: np.ndarray, vocab_size: int):
        self.keys, self.tokens, self.cells = keys, tokens, cells
        self.hit_rate = np.asarray(hit_rate, dtype=np.float64)
        self.vocab_size = int(vocab_size)
        self.max_order = len(keys)
        self.bits = token_bits(self.vocab_size)

    @classmethod
    def load(cls, path: str | Path) -> NgramTable:
        try:
            with np.load(path) as z:
                order = int(z["max_order"])
                keys = [z[f"keys{k}"] for k in range(1, order + 1)]
                tokens = [z[f"tokens{k}"].astype(np.int64) for k in range(1, order + 1)]
                cells = [z[f"cells{k}"].astype(np.int64) for k in range(1, order + 1)]
                hit_rate, vocab = z["hit_rate"], int(z["vocab_size"])
        except (OSError, KeyError, ValueError) as exc:
            raise BundleError(f"Cannot read the n-gram table '{path}' ({exc}).") from None
        cells_total = order * (len(COUNT_EDGES) + 1) * SHARE_BINS
        if not 1 <= order <= max_order(vocab) or len(hit_rate) != cells_total or any(
                k.dtype != np.uint64 or len(k) != len(t) or len(k) != len(c) or (len(c) and c.max() >= cells_total)
                for k, t, c in zip(keys, tokens, cells)):
            raise BundleError(f"The n-gram table '{path}' is corrupt (inconsistent arrays).")
        return cls(keys, tokens, cells, hit_rate, vocab)

    def arrays(self) -> dict[str, np.ndarray]:
        """What :meth:`load` reads back (``np.savez``)."""
        out: dict[str, np.ndarray] = {"max_order": np.array(self.max_order), "hit_rate": self.hit_rate.astype(np.float32),
                                      "vocab_size": np.array(self.vocab_size)}
        for k in range(1, self.max_order + 1):
            out[f"keys{k}"] = self.keys[k - 1]
            out[f"tokens{k}"] = self.tokens[k - 1].astype(np.uint16 if self.bits == TOKEN_BITS else np.uint32)
            out[f"cells{k}"] = self.cells[k - 1].astype(np.uint16)
        return out

    def predict(self, context: list[int], longest: int = MAX_ORDER) -> tuple[int, int, int]:
        """(next token, calibration cell, context order) from the longest known suffix of ``context``, of at
        most ``longest`` tokens; (-1, -1, 0) if none."""
        for k in range(min(self.max_order, longest, len(context)), 0, -1):
            keys = self.keys[k - 1]
            key = pack(context[-k:], self.bits)
            at = int(keys.searchsorted(np.uint64(key)))
            if at < len(keys) and int(keys[at]) == key:
                return int(self.tokens[k - 1][at]), int(self.cells[k - 1][at]), k
        return -1, -1, 0

    def chain(self, context: list[int], max_len: int, scale: float = 1.0,
              floor: float = CHAIN_FLOOR) -> tuple[list[int], list[float]]:
        """Up to ``max_len`` tokens drafted greedily from the table, with each one's calibrated chance of
        acceptance given the ones before were accepted. The chain stops where the chance that all of it is
        accepted (each chance times ``scale``) falls below ``floor``: tokens past that cannot pay."""
        context = list(context[-self.max_order:])
        out: list[int] = []
        chances: list[float] = []
        longest, reach = self.max_order, 1.0
        for _ in range(max_len):
            tok, where, order = self.predict(context, longest)
            if tok < 0 or reach < floor:
                break
            chance = float(self.hit_rate[where])
            out.append(tok)
            chances.append(chance)
            reach *= min(chance * scale, MAX_CHANCE)
            # A context one token longer than this one's can be known only if this one was (its prefix).
            longest = order + 1
            context = context[1:] + [tok] if len(context) == self.max_order else context + [tok]
        return out, chances


class NgramDrafter(PromptLookupDrafter):
    """Prompt lookup or the model's n-gram table, per step, whichever drafts more tokens per unit of cost."""

    kind = NGRAM

    def __init__(self, table: NgramTable, **lookup_options):
        self.table = table
        self.sources = {"lookup": 0, "table": 0, "plain": 0}  # steps by the source of their draft, all sequences
        super().__init__(**lookup_options)

    def reset(self) -> None:
        super().reset()
        # Online check of the table's calibration on this sequence: predicted and earned acceptances
        # of the chain tokens it has drafted (a prior of 8 tokens at the calibrated rate).
        self._predicted, self._earned = 8.0, 8.0
        self._table_draft: np.ndarray | None = None  # the chance of each token of the last table chain
        self._table_value = 0.0  # its expected tokens per unit of step cost

    def profile(self) -> dict:
        return {"steps_by_source": dict(self.sources)}

    def _table_chain(self, tokens: np.ndarray, budget: int) -> tuple[list[int], np.ndarray, float]:
        """The table's chain cut to its best length, each token's calibrated chance (before this
        sequence's scaling), and its expected tokens per unit of cost."""
        scale = self._earned / self._predicted
        chain, calibrated = self.table.chain(tokens[-self.table.max_order:].tolist(), min(self.num_tokens, budget),
                                             scale)
        expected = reach = 1.0
        best, best_value = 0, 1.0  # L = 0: a plain step
        for length, chance in enumerate(calibrated, start=1):
            reach *= min(chance * scale, MAX_CHANCE)
            expected += reach
            value = expected / self._cost[length]
            if value > best_value:
                best, best_value = length, value
        return chain[:best], np.asarray(calibrated[:best]), (best_value if best else 0.0)

    def _table_instead(self, tokens: np.ndarray, budget: int, lookup_value: float) -> list[int]:
        """The table's chain where it is worth more than lookup's proposal (``lookup_value``), else []."""
        chain, chance, value = self._table_chain(tokens, budget) if budget > 0 else ([], None, 0.0)
        self._table_draft = None
        if not chain or value <= lookup_value:
            return []
        self._table_draft, self._table_value = chance, value
        self.sources["table"] += 1
        return chain

    def propose(self, ctx: DraftContext) -> DraftTree:
        found = super().propose(ctx)
        tokens = np.asarray(ctx.tokens, dtype=np.int64)
        budget = min(ctx.max_nodes, self.max_nodes or ctx.max_nodes) - 1
        match = self.last_match
        chain = self._table_instead(tokens, budget, found.value)  # 1.0: lookup found nothing
        if chain:
            self._last = None  # lookup learns nothing from a step it did not draft
            return DraftTree.chain([int(tokens[-1]), *chain]).priced(self._table_value)
        self.sources["lookup" if match is not None else "plain"] += 1
        return found

    def chain(self, tokens: np.ndarray, max_len: int) -> tuple[int, list[int]]:
        """Lookup's chain or the table's, whichever is worth more, as in :meth:`propose` (0 and [] when
        neither pays); the first value is the match's n-gram size, or ``TABLE_SOURCE`` for the table's."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n, cont = super().chain(tokens, max_len)
        table = self._table_instead(tokens, max_len, self.worth(n if cont else None, len(cont), 1 + len(cont)))
        if table:
            return TABLE_SOURCE, table
        self.sources["lookup" if cont else "plain"] += 1
        return n, cont

    def record(self, n: int, accepted: int, drafted: int) -> None:
        if n != TABLE_SOURCE:
            super().record(n, accepted, drafted)
        elif self._table_draft is not None:
            self._learn(accepted)

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self._table_draft is None:
            super().accepted(nodes, tree)
            return
        self._learn(len(nodes) - 1)

    def _learn(self, accepted: int) -> None:
        """``accepted`` tokens of the last table chain were accepted: weigh them against its chances."""
        judged = min(accepted + 1, len(self._table_draft))  # tokens up to the first rejected one
        self._predicted += float(np.sum(self._table_draft[:judged]))
        self._earned += accepted
        self._table_draft = None


def load_ngram_drafter(bundle_dir: Path, manifest: BundleManifest) -> NgramDrafter:
    """The bundle's n-gram drafter; one sentence when the bundle has no table or a damaged one."""
    entry = next((d for d in manifest.drafts if d.kind == NGRAM), None)
    if entry is None:
        raise DraftMismatchError(
            f"The bundle {bundle_dir} has no n-gram table; add one with 'specdeploy export draft --kind ngram "
            f"--draft graphs/weights/self-replies.npz {bundle_dir}' (the replies of its own base model).")
    if entry.base_weight_sha != manifest.source.weight_sha:
        raise DraftMismatchError("The bundle's n-gram table was made for another base model; export it again.")
    path = Path(bundle_dir) / entry.setting("table", TABLE_FILE)
    if not path.is_file() or hash_files([path]) != entry.weights_sha:
        raise BundleError(f"The n-gram table {path} is missing or does not match the bundle's manifest.")
    table = NgramTable.load(path)
    if table.vocab_size != manifest.model.vocab_size:
        raise BundleError(f"The n-gram table {path} is for a vocabulary of {table.vocab_size} ids, not "
                          f"{manifest.model.vocab_size}.")
    return NgramDrafter(table)
