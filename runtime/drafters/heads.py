"""Medusa and Cerberus drafters: the heads graph gives top-k tokens per depth; a tree is built from them.

Both run the bundle's heads graph on the base hidden state of the last accepted node,
``ctx.hidden[-1]``. That node's logits produced the root token, so head k proposes the token k+1
places after the root. Trees are static (a :class:`TreeSpec` filled with each depth's top-k) or
dynamic (EAGLE-2 style: grow by cumulative log-prob, keep the best nodes within the budget).

Cerberus adds a gate, asked before every step: from its signal (the entropy of the distribution
that produced the root, or the learned gate's acceptance probability, whichever the draft's
calibration chose) and the measured costs, :class:`CostAwareGate` drafts exactly when drafting is
expected to pay, and otherwise runs the step as plain decoding, T=1 with no draft cost. It learns
the signal's meaning from the verdicts, on this machine.

A chain (``chainN``, and every chain a chains-only step plan runs) keeps only the prefix worth
verifying: :class:`ChainPolicy` weighs the heads' calibrated confidence against the measured cost
of each extra row (a plain step when no drafted token is worth its row).

numpy and onnxruntime only: this is part of the lean runtime.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..bundle import BundleManifest, DraftEntry, GraphEntry
from ..contract import HIDDEN_STATES, LOGITS
from ..draft_contract import HEADS
from ..errors import DraftMismatchError, SpecDeployError, TreeSpecError
from ..precision import QUANTIZED_DRAFT_PRECISIONS
from ..tree import DraftTree, TreeSpec, select_dynamic
from ..tree_cost import CPU_COST_CURVE, DEFAULT_ACCEPT, choose_default_tree
from ..tree_table import STATIC_TREES, tree_choice
from .base import DraftContext, Drafter
from .depth import ChainPolicy, CostAwareGate
from .kinds import TRAINED_DRAFTS, describe

HEADS_DRAFTS = tuple(k for k in TRAINED_DRAFTS if describe(k).role(HEADS))  # medusa, cerberus, cerberus-nogate
GATE_KINDS = ("entropy", "learned")


class GateConfigError(SpecDeployError):
    """A gate is unknown, or a gate is needed and the draft has no calibration."""


@dataclass(frozen=True)
class GateSpec:
    """Which signal the gate reads: the root distribution's entropy, or the learned gate's P(accepted >= 1)."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in GATE_KINDS:
            raise GateConfigError(f"Unknown gate '{self.kind}'; choose one of {', '.join(GATE_KINDS)}.")

    def signal(self, entropy: float, prob: float) -> float:
        """A score in [0, 1] that rises with the chance that drafting pays: ``1 / (1 + entropy)`` spreads
        the entropies that matter (0 to a few nats) over the calibration's bands."""
        return prob if self.kind == "learned" else 1.0 / (1.0 + max(entropy, 0.0))


class HeadsDrafter(Drafter):
    """Runs the heads graph once per step and fills a static or dynamic tree with its top-k."""

    def __init__(self, kind: str, session, num_heads: int, topk: int, tree: TreeSpec | None = None,
                 dynamic_nodes: int | None = None, gate: GateSpec | None = None, gate_session=None):
        check_tree_choice(tree, dynamic_nodes, kind, num_heads, topk)
        if gate is not None and gate_session is None:
            raise GateConfigError(f"The {kind} gate needs the bundle's '{kind}-gate' graph.")
        self.kind = kind
        self.session, self.gate_session = session, gate_session
        self.num_heads, self.topk = num_heads, topk
        self.tree, self.dynamic_nodes, self.gate = tree, dynamic_nodes, gate
        self.adaptive = tree is not None and tree.is_chain  # a chain keeps the prefix worth verifying
        self.policy = ChainPolicy(tree.depth if self.adaptive else num_heads)
        self.gate_policy = CostAwareGate(self.policy) if gate is not None else None

    @property
    def needs_cost_curve(self) -> bool:
        return self.adaptive or self.gate is not None

    def use_cost_curve(self, cost_curve) -> None:
        self.policy.use_cost_curve(cost_curve)

    def wants_draft(self, ctx: DraftContext) -> bool:
        observed = self.policy.observe(ctx.tokens) if self.adaptive else None
        if self.gate_policy is not None:
            self.gate_policy.settle(observed)
        if self.gate is None or ctx.root_logits is None:
            return True
        hidden = np.ascontiguousarray(ctx.hidden[-1:], dtype=np.float32)[None]  # [1, 1, H]
        logits = np.ascontiguousarray(ctx.root_logits, dtype=np.float32).reshape(1, 1, -1)  # [1, 1, V]
        entropy, prob = self.gate_session.run(None, {HIDDEN_STATES: hidden, LOGITS: logits})
        rows = None if self.adaptive else (self.tree.num_nodes if self.tree else self.dynamic_nodes)
        return self.gate_policy.drafts(self.gate.signal(float(entropy[0, 0]), float(prob[0, 0])), rows)

    def head_topk(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``hidden [H]`` -> (ids ``[K, k]``, log-probs ``[K, k]``) of every head, best first."""
        x = np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, 1, -1)  # [1, 1, H]
        ids, logp = self.session.run(None, {HIDDEN_STATES: x})  # [1, 1, K, k] each
        return ids[0, 0], logp[0, 0]

    def propose(self, ctx: DraftContext) -> DraftTree:
        root = int(ctx.tokens[-1])
        if self.adaptive:  # (a no-op when wants_draft already settled it)
            self.policy.observe(ctx.tokens)
        timer = self.policy.timer
        timer.start()
        t0 = time.perf_counter()
        ids, logp = self.head_topk(ctx.hidden[-1])
        timer.timed(time.perf_counter() - t0)
        if not self.adaptive:
            return tree_from_topk(self.tree, self.dynamic_nodes, root, ids, logp, ctx.max_nodes)
        probs = np.exp(logp[: self.tree.depth, 0])
        return self.policy.chain(ctx.tokens, ids[:, 0], probs, 1, ctx.max_nodes)

    def profile(self) -> dict:
        out = self.policy.timer.profile()
        if self.gate_policy is not None:
            out["gate"] = dict(self.gate_policy.decisions)
        return out

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        if self.gate_policy is not None:
            self.gate_policy.verdict(len(nodes) - 1, tree.num_nodes - 1)
        if self.adaptive:
            self.policy.verdict(len(nodes) - 1)
        else:
            self.policy.timer.stop()


def check_tree_choice(tree: TreeSpec | None, dynamic_nodes: int | None, kind: str, num_heads: int,
                      topk: int) -> None:
    """Exactly one of a static tree and a dynamic budget; a static tree within the draft's heads and top-k."""
    if (tree is None) == (dynamic_nodes is None):
        raise TreeSpecError(f"The {kind} drafter needs either a static tree or a dynamic node budget.")
    if tree is not None and (tree.depth > num_heads or tree.topk > topk):
        raise TreeSpecError(
            f"The tree needs {tree.depth} heads with top-{tree.topk}; the {kind} draft has {num_heads} "
            f"heads with top-{topk}."
        )


def tree_from_topk(spec: TreeSpec | None, dynamic_nodes: int | None, root: int, ids: np.ndarray,
                   logp: np.ndarray, max_nodes: int) -> DraftTree:
    """Fill a static tree with per-depth top-k ``ids [D, k]`` (cut to ``max_nodes``), or grow a dynamic one."""
    if spec is not None:
        tree = DraftTree.from_static(spec, root, ids)
        n = min(max_nodes, tree.num_nodes)  # a prefix of a sorted static tree is a tree
        return tree if n == tree.num_nodes else DraftTree(tree.tokens[:n], tree.parents[:n])
    return dynamic_tree(ids, logp, root, min(max_nodes, dynamic_nodes or max_nodes))


def dynamic_tree(ids: np.ndarray, logp: np.ndarray, root: int, max_nodes: int, width: int = 10) -> DraftTree:
    """EAGLE-2-style tree from per-depth top-k: expand the ``width`` best nodes of each depth, keep the best.

    ``ids``/``logp``: [D, k]. A node's score is its path's summed log-prob (heads are independent
    given h_t, so that is the product of their probabilities), which never rises along a path.
    """
    depth, k = ids.shape
    budget = max_nodes - 1
    if budget <= 0:
        return DraftTree(np.array([root], dtype=np.int64), np.array([-1], dtype=np.int64))
    parents, tokens, scores = [], [], []
    frontier = [(-1, 0.0)]  # (candidate index, cumulative score); -1 is the root
    for d in range(depth):
        nxt = []
        for parent, base in frontier:
            for r in range(k):
                parents.append(parent)
                tokens.append(int(ids[d, r]))
                scores.append(base + float(logp[d, r]))
                nxt.append((len(tokens) - 1, scores[-1]))
        nxt.sort(key=lambda c: -c[1])
        frontier = nxt[: min(width, budget)]
    return select_dynamic(parents, tokens, scores, budget, root_token=root)


# --- loading from a bundle -------------------------------------------------------------------------
def draft_graph(entry: DraftEntry, role: str) -> GraphEntry:
    for g in entry.graphs:
        if g.role == role:
            return g
    raise DraftMismatchError(f"The bundle's {entry.kind} draft has no '{role}' graph; re-export it.")


def check_entry(entry: DraftEntry, manifest: BundleManifest) -> None:
    """The draft must have been exported for this bundle's base model."""
    if entry.base_weight_sha != manifest.source.weight_sha:
        raise DraftMismatchError(
            f"The bundle's {entry.kind} draft was trained for another base model (weight hash "
            f"{entry.base_weight_sha[:12]}, the bundle's base is {manifest.source.weight_sha[:12]})."
        )
    m = manifest.model
    if entry.setting("hidden_size") != m.hidden_size or entry.setting("vocab_size") != m.vocab_size:
        raise DraftMismatchError(
            f"The bundle's {entry.kind} draft expects hidden size {entry.setting('hidden_size')} and vocabulary "
            f"{entry.setting('vocab_size')}, but the base model has {m.hidden_size} and {m.vocab_size}."
        )
    if entry.setting("kind", entry.kind) != entry.kind:
        raise DraftMismatchError(
            f"The bundle's '{entry.kind}' draft entry holds a {entry.setting('kind')} draft; re-export it."
        )


def gate_from_entry(entry: DraftEntry) -> GateSpec:
    kind = entry.setting("gate_kind")
    if kind in (None, ""):
        raise GateConfigError(
            f"The bundle's {entry.kind} draft has no gate calibration; export it with a calibration file "
            "(specdeploy train calibrate) or use the 'cerberus-nogate' draft."
        )
    return GateSpec(str(kind))


def default_tree(entry: DraftEntry) -> str:
    """The calibrated tree, else the cost model's choice under the draft's measured acceptance."""
    name = entry.setting("default_tree")
    if name:
        return str(name)
    accept = entry.setting("accept")
    accept = np.asarray(accept, dtype=np.float64) if accept else DEFAULT_ACCEPT
    depth = int(entry.setting("num_heads", 0) or 0)
    fits = {k: v for k, v in STATIC_TREES.items() if not depth or v.depth <= depth}
    if not fits:  # fewer heads than any registered tree is deep: a chain over all of them
        return json.dumps([[0] * d for d in range(1, depth + 1)])
    return choose_default_tree(CPU_COST_CURVE, accept, fits)


def resolve_tree(tree: str | None, entry: DraftEntry, manifest: BundleManifest, num_heads: int,
                 chains: bool = False) -> tuple[TreeSpec | None, int | None]:
    """``--tree`` (or the draft's default) as a static spec or a dynamic node budget, checked against limits."""
    if tree in (None, "", "auto"):  # a chain is drafted adaptively: let it reach every head
        tree = f"chain{num_heads}" if chains else default_tree(entry)
    return tree_choice(tree, manifest.limits.max_tree, num_heads)


def cpu_graph_role(entry: DraftEntry, precision: str = "auto") -> str:
    """The draft graph the CPU drafter runs (heads or Chimera). "auto": the draft's int4 graph, else its int8
    one, else the fp32 ``<kind>``; "int4" or "int8" without that graph gets one sentence; "fp32" the fp32 one."""
    roles = {g.role for g in entry.graphs}
    if precision == "auto":
        return next((f"{entry.kind}-{p}" for p in QUANTIZED_DRAFT_PRECISIONS if f"{entry.kind}-{p}" in roles),
                    entry.kind)
    if precision in QUANTIZED_DRAFT_PRECISIONS:
        if f"{entry.kind}-{precision}" not in roles:
            raise DraftMismatchError(f"The bundle's {entry.kind} draft has no {precision} graph; re-export it with "
                                     f"--precision {precision}.")
        return f"{entry.kind}-{precision}"
    return entry.kind


def make_heads_drafter(name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None = None,
                       threads: int | None = None, chains: bool = False, precision: str = "auto") -> HeadsDrafter:
    """``medusa``, ``cerberus`` (with its calibrated gate) or ``cerberus-nogate`` from the bundle; the heads
    graph as :func:`cpu_graph_role` picks it."""
    from ..backends.ort import make_draft_session

    if name not in HEADS_DRAFTS:
        raise DraftMismatchError(f"Unknown heads draft '{name}'; choose one of {', '.join(HEADS_DRAFTS)}.")
    desc = describe(name)
    kind = desc.bundle_kind
    entry = manifest.draft(kind)
    check_entry(entry, manifest)
    num_heads, topk = int(entry.setting("num_heads")), int(entry.setting("topk"))
    gate = gate_from_entry(entry) if desc.gated else None

    spec, dynamic = resolve_tree(tree, entry, manifest, num_heads, chains)

    session = make_draft_session(Path(bundle_dir) / draft_graph(entry, cpu_graph_role(entry, precision)).file)
    gate_session = None
    if gate is not None:
        gate_session = make_draft_session(Path(bundle_dir) / draft_graph(entry, desc.gate_role.role).file)
    return HeadsDrafter(kind, session, num_heads, topk, spec, dynamic, gate, gate_session)

