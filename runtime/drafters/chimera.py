"""Chimera drafter: the bundle's draft-step graph over its own small KV cache, then a tree from the heads.

Per step (see ``graphs/chimera.py`` for the model):

1. **Catch up.** The base hidden states of the nodes accepted last step (``ctx.hidden``, A rows)
   become A real draft slots, each with the trigram ending at the token after it. Their K/V are
   written into the draft cache for good; the call also returns head 1's top-k from the last slot.
   A caller may hand over only the latest states (the hybrid's rule caps a catch-up): the slots before
   them stay empty and are masked out for good, so nothing reads them.
2. **Chain.** For depth d = 2..K the previous depth's feature and the trigram ending at the previous
   head's argmax go through the same layer as one scratch slot (written after the real slots and
   overwritten next step), giving head d's top-k.
3. **Tree.** A static tree (a :class:`TreeSpec`) or a dynamic one is filled from the per-depth top-k,
   as for the Medusa heads; verification by the base model keeps the output lossless.

A chain (``chainN``, and every chain a chains-only step plan runs) is drafted adaptively: after each
depth, :class:`ChainPolicy` asks whether a deeper chain is expected to pay for its calls, from the
draft's calibrated confidence and the measured costs, and keeps the prefix worth verifying (possibly
none: a plain step). N is then the most it drafts.

The draft cache holds ``[1, Hkv, C, D]`` per K and V, bound in place with IOBinding (present aliases
past), and grows by doubling. numpy and onnxruntime only: this is part of the lean runtime.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from .. import draft_contract as dc
from ..bundle import BundleManifest, DraftEntry
from ..contract import parse_feature_layers
from ..errors import DraftMismatchError
from ..tree import DraftTree, TreeSpec
from .base import DraftContext, Drafter
from .depth import ChainPolicy
from .heads import check_entry, check_tree_choice, cpu_graph_role, draft_graph, resolve_tree, tree_from_topk
from .kinds import CHIMERA

MIN_CAPACITY = 256


class ChimeraDrafter(Drafter):
    kind = CHIMERA

    def __init__(self, session, num_heads: int, num_kv_heads: int, head_dim: int, topk: int,
                 tree: TreeSpec | None = None, dynamic_nodes: int | None = None, depth: int | None = None,
                 feature_layers: tuple[int, ...] = ()):
        check_tree_choice(tree, dynamic_nodes, "Chimera", num_heads, topk)
        self.session = session
        # A draft that fuses base layers (EAGLE-3) reads their states at its real slots (DraftContext.layers).
        self.feature_layers = tuple(feature_layers)
        self.num_heads, self.topk = num_heads, topk
        self.tree, self.dynamic_nodes = tree, dynamic_nodes
        self.depth = tree.depth if tree is not None else min(depth or num_heads, num_heads)
        # A chain stops where going deeper does not pay (the policy learns across generations).
        self.policy = ChainPolicy(self.depth) if tree is not None and tree.is_chain else None
        self._kv_shape = (1, num_kv_heads, 0, head_dim)
        self._neg = np.finfo(np.float32).min
        self.reset()

    @property
    def needs_cost_curve(self) -> bool:
        return self.policy is not None

    def use_cost_curve(self, cost_curve) -> None:
        if self.policy is not None:
            self.policy.use_cost_curve(cost_curve)

    def spawn(self) -> ChimeraDrafter:
        """The same draft graph's session (loading it again took about 40 ms a request in a batching engine), the
        chain policy's learning so far, and a draft cache of its own."""
        twin = copy.copy(self)
        twin.policy = copy.deepcopy(self.policy)
        twin.reset()
        return twin

    def reset(self) -> None:
        self.length = 0  # committed real draft slots
        self._k = self._v = None
        self._open: np.ndarray | None = None  # per slot: 0.0 where it may be attended, the mask's minimum in a gap
        self._ov: tuple = ()
        self._binding = None  # the session's IOBinding over the current cache buffers

    # --- the draft cache ----------------------------------------------------------------------------
    def _ensure(self, needed: int) -> None:
        cap = 0 if self._k is None else self._k.shape[2]
        if needed <= cap:
            return
        new_cap = max(MIN_CAPACITY, cap)
        while new_cap < needed:
            new_cap *= 2
        self._grow((self._kv_shape[0], self._kv_shape[1], new_cap, self._kv_shape[3]), cap)

    def _grow(self, shape: tuple[int, ...], cap: int) -> None:
        """Replace the draft cache by zeroed buffers of ``shape`` holding its first ``cap`` slots."""
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        is_open = np.zeros(shape[2], np.float32)
        if self._k is not None:
            k[:, :, :cap] = self._k
            v[:, :, :cap] = self._v
            is_open[:cap] = self._open
        self._open = is_open
        import onnxruntime as ort

        self._k, self._v = k, v
        self._ov = (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v))
        self._binding = None

    def check(self, manifest: BundleManifest) -> None:
        if self.feature_layers:
            lacking = manifest.base_files_without(self.feature_layers)
            if lacking:
                raise DraftMismatchError(f"This Chimera draft fuses base layers {list(self.feature_layers)}, but "
                                         f"{', '.join(lacking)} do not output them.")

    def _run(self, hidden: np.ndarray, trigrams: np.ndarray, start: int, base_hidden: np.ndarray, head: int,
             layers: np.ndarray | None = None):
        """Write ``T`` slots at ``start..start+T`` (seeing ``[0, start)`` and each other causally).

        A fusing draft's real slots read ``layers`` (``hidden`` is then ignored); its chain slots read ``hidden``.
        """
        t = hidden.shape[0]
        self._ensure(start + t)
        cap = self._k.shape[2]
        mask = np.full((1, 1, t, cap), self._neg, dtype=np.float32)
        mask[..., :start] = self._open[:start]
        mask[0, 0, :, start : start + t] = np.where(np.tril(np.ones((t, t), dtype=bool)), 0.0, self._neg)
        b = self._binding
        if b is None:  # made once per cache buffer set: a call then rebinds only its small inputs and outputs
            b = self._binding = self.session.io_binding()
            b.bind_ortvalue_input(dc.PAST_KEY, self._ov[0])
            b.bind_ortvalue_input(dc.PAST_VALUE, self._ov[1])
            b.bind_ortvalue_output(dc.PRESENT_KEY, self._ov[0])  # in place; outputs 0 and 1
            b.bind_ortvalue_output(dc.PRESENT_VALUE, self._ov[1])
        for name in (dc.FEATURE, dc.TOPK_IDS, dc.TOPK_LOGPROBS):  # outputs 2..4, fresh each call
            b.bind_output(name)
        b.bind_cpu_input(dc.HIDDEN, np.ascontiguousarray(hidden, dtype=np.float32)[None])
        if self.feature_layers:
            real = layers is not None
            if not real:
                layers = np.zeros((t, len(self.feature_layers) * hidden.shape[1]), dtype=np.float32)
            b.bind_cpu_input(dc.LAYER_STATES, np.ascontiguousarray(layers, dtype=np.float32)[None])
            b.bind_cpu_input(dc.FROM_LAYERS, np.array([1.0 if real else 0.0], dtype=np.float32))
        b.bind_cpu_input(dc.TRIGRAM_IDS, np.ascontiguousarray(trigrams, dtype=np.int64)[None])
        b.bind_cpu_input(dc.POSITION_IDS, np.arange(start, start + t, dtype=np.int64)[None])
        b.bind_cpu_input(dc.ATTENTION_MASK, mask)
        b.bind_cpu_input(dc.WRITE_INDICES, np.arange(start, start + t, dtype=np.int64))
        b.bind_cpu_input(dc.BASE_HIDDEN, np.ascontiguousarray(base_hidden, dtype=np.float32)[None])
        b.bind_cpu_input(dc.HEAD_INDEX, np.array([head], dtype=np.int64))
        t0 = time.perf_counter()
        self.session.run_with_iobinding(b)
        if self.policy is not None:
            self.policy.timer.timed(time.perf_counter() - t0, rows=t)
        feat, ids, logp = (o.numpy() for o in b.get_outputs()[2:5])
        return feat[0], ids[0], logp[0]

    # --- drafting -----------------------------------------------------------------------------------
    def head_topk(self, tokens: np.ndarray, hidden: np.ndarray, adaptive: bool = False,
                  layers: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Catch up on ``hidden`` (the newly accepted base states) and chain ``depth`` heads.

        ``tokens [L]`` ends with the root; ``hidden [A, H]`` are the base states of tokens
        ``L-1-A .. L-2`` (``layers [A, taps*H]`` their tapped states, for a fusing draft). Returns ids and log-probs ``[D, k]``: D = ``depth``, or fewer where
        ``adaptive`` and the chain policy stopped.
        """
        n_tok, a = len(tokens), hidden.shape[0]
        start = n_tok - 1 - a
        if start < self.length:
            raise DraftMismatchError(
                f"The Chimera drafter lost track of the context ({self.length} draft slots, {start} expected)."
            )
        if start > self.length:  # the caller kept only the latest states: the slots between stay empty, unseen
            self._ensure(start)
            self._open[self.length : start] = self._neg
        # Real slot j's trigram is (x_{j-1}, x_j, x_{j+1}), the earliest token repeated at the start.
        idx = np.arange(start, start + a)
        tokens = np.asarray(tokens, dtype=np.int64)
        tri = np.stack([tokens[np.maximum(idx - 1, 0)], tokens[idx], tokens[idx + 1]], axis=-1)
        off = n_tok - 2  # the chain's trigrams only reach back to x_{L-2} (L >= 2: prompt + root)
        seq = [int(x) for x in tokens[off:]]
        base_h = hidden[-1]
        if self.feature_layers and (layers is None or len(layers) != a):
            raise DraftMismatchError("This Chimera draft fuses base layers, but the backend returned no layer states.")
        feat, ids, logp = self._run(hidden, tri, start, base_h, 0, layers if self.feature_layers else None)
        self.length = start + a
        all_ids, all_logp = [ids], [logp]
        for d in range(2, self.depth + 1):
            if adaptive and not self.policy.another_call(np.exp([lp[0] for lp in all_logp]), d - 1):
                break
            seq.append(int(ids[0]))  # the previous head's argmax extends the chain
            slot = self.length + d - 2  # scratch slot; its trigram ends at the new chain token
            k = slot - off
            tri = np.array([[seq[k - 1], seq[k], seq[k + 1]]], dtype=np.int64)
            feat, ids, logp = self._run(feat[None], tri, slot, base_h, d - 1)
            all_ids.append(ids)
            all_logp.append(logp)
        return np.stack(all_ids), np.stack(all_logp)

    def propose(self, ctx: DraftContext) -> DraftTree:
        root = int(ctx.tokens[-1])
        if self.policy is None:
            ids, logp = self.head_topk(ctx.tokens, ctx.hidden, layers=ctx.layers)
            return tree_from_topk(self.tree, self.dynamic_nodes, root, ids, logp, ctx.max_nodes)
        self.policy.observe(ctx.tokens)
        self.policy.timer.start()
        ids, logp = self.head_topk(ctx.tokens, ctx.hidden, adaptive=True, layers=ctx.layers)
        probs = np.exp(logp[:, 0])
        return self.policy.chain(ctx.tokens, ids[:, 0], probs, len(ids), ctx.max_nodes)

    def profile(self) -> dict:
        return self.policy.timer.profile() if self.policy is not None else {}

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self.policy is not None:
            self.policy.verdict(len(nodes) - 1)


def make_chimera_drafter(bundle_dir: Path, manifest: BundleManifest, tree: str | None = None,
                         threads: int | None = None, precision: str = "auto", chains: bool = False) -> ChimeraDrafter:
    """The bundle's Chimera drafter; its graph as :func:`cpu_graph_role` picks it (``precision``)."""
    from ..backends.ort import make_draft_session

    entry: DraftEntry = manifest.draft(CHIMERA)
    check_entry(entry, manifest)
    num_heads, topk = int(entry.setting("num_heads")), int(entry.setting("topk"))
    spec, dynamic = resolve_tree(tree, entry, manifest, num_heads, chains)
    session = make_draft_session(Path(bundle_dir) / draft_graph(entry, cpu_graph_role(entry, precision)).file)
    taps = parse_feature_layers(entry.setting("feature_layers"))
    return ChimeraDrafter(session, num_heads, int(entry.setting("num_kv_heads")), int(entry.setting("head_dim")),
                          topk, spec, dynamic, feature_layers=taps)
