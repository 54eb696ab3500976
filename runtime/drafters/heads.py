"""Medusa and Cerberus drafters: the heads graph gives top-k tokens per depth; a tree is built from them.

Both run the bundle's heads graph on the base hidden state of the last accepted node,
``ctx.hidden[-1]``. That node's logits produced the root token, so head k proposes the token k+1
places after the root. Trees are static (a :class:`TreeSpec` filled with each depth's top-k) or
dynamic (EAGLE-2 style: grow by cumulative log-prob, keep the best nodes within the budget).

Cerberus adds a gate, asked before every step: when the base model is unsure (high entropy of
the distribution that produced the root, or a low learned acceptance probability) the step runs
as plain autoregressive decoding, T=1 with no draft cost. The gate kind and its threshold come
from the draft's calibration, recorded in the bundle manifest.

numpy and onnxruntime only: this is part of the lean runtime.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..bundle import BundleManifest, DraftEntry, GraphEntry
from ..errors import DraftMismatchError, SpecDeployError, TreeSpecError
from ..tree import (
    CPU_COST_CURVE,
    DEFAULT_ACCEPT,
    STATIC_TREES,
    DraftTree,
    TreeSpec,
    choose_default_tree,
    select_dynamic,
    tree_choice,
)
from .base import DraftContext, Drafter

HEADS_DRAFTS = ("medusa", "cerberus", "cerberus-nogate")
GATE_KINDS = ("entropy", "learned")


class GateConfigError(SpecDeployError):
    """A gate threshold is out of range, or a gate is needed and the draft has no calibration."""


@dataclass(frozen=True)
class GateSpec:
    """Draft when ``entropy < threshold`` (nats, entropy gate) or ``gate_prob >= threshold`` (learned gate)."""

    kind: str
    threshold: float
    vocab_size: int

    def __post_init__(self) -> None:
        if self.kind not in GATE_KINDS:
            raise GateConfigError(f"Unknown gate '{self.kind}'; choose one of {', '.join(GATE_KINDS)}.")
        t = self.threshold
        if self.kind == "entropy":
            hi = math.log(self.vocab_size)
            if not (isinstance(t, (int, float)) and 0.0 <= t <= hi):
                raise GateConfigError(
                    f"The entropy gate threshold must be between 0 and ln(vocab) = {hi:.2f} nats, got {t}."
                )
        elif not (isinstance(t, (int, float)) and 0.0 <= t <= 1.0):
            raise GateConfigError(f"The learned gate threshold is a probability between 0 and 1, got {t}.")

    def drafts(self, entropy: float, prob: float) -> bool:
        return entropy < self.threshold if self.kind == "entropy" else prob >= self.threshold

    @property
    def never_drafts(self) -> bool:
        """True when no step can pass (an entropy threshold of 0 nats): the gate need not run at all.

        Calibration picks this when no threshold beats plain decoding; running the gate graph anyway
        cost ~3% of a plain step on the 4-bit CPU graph (softmax entropy over the whole vocabulary).
        """
        return self.kind == "entropy" and self.threshold <= 0.0


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

    def wants_draft(self, ctx: DraftContext) -> bool:
        if self.gate is None or ctx.root_logits is None:
            return True
        if self.gate.never_drafts:
            return False
        hidden = np.ascontiguousarray(ctx.hidden[-1:], dtype=np.float32)[None]  # [1, 1, H]
        logits = np.ascontiguousarray(ctx.root_logits, dtype=np.float32).reshape(1, 1, -1)  # [1, 1, V]
        entropy, prob = self.gate_session.run(None, {"hidden_states": hidden, "logits": logits})
        return self.gate.drafts(float(entropy[0, 0]), float(prob[0, 0]))

    def head_topk(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``hidden [H]`` -> (ids ``[K, k]``, log-probs ``[K, k]``) of every head, best first."""
        x = np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, 1, -1)  # [1, 1, H]
        ids, logp = self.session.run(None, {"hidden_states": x})  # [1, 1, K, k] each
        return ids[0, 0], logp[0, 0]

    def propose(self, ctx: DraftContext) -> DraftTree:
        root = int(ctx.tokens[-1])
        ids, logp = self.head_topk(ctx.hidden[-1])
        return tree_from_topk(self.tree, self.dynamic_nodes, root, ids, logp, ctx.max_nodes)


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


def gate_from_entry(entry: DraftEntry, vocab_size: int) -> GateSpec:
    kind, threshold = entry.setting("gate_kind"), entry.setting("gate_threshold")
    if kind in (None, "") or threshold is None:
        raise GateConfigError(
            f"The bundle's {entry.kind} draft has no gate calibration; export it with a calibration file "
            "(specdeploy train calibrate) or use the 'cerberus-nogate' draft."
        )
    return GateSpec(str(kind), float(threshold), vocab_size)


def default_tree(entry: DraftEntry, chains: bool = False) -> str:
    """The calibrated tree (the calibrated chain under a chains-only step plan), else the cost model's
    choice under the draft's measured acceptance."""
    name = (chains and entry.setting("default_chain")) or entry.setting("default_tree")
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
    tree = tree if tree not in (None, "", "auto") else default_tree(entry, chains)
    return tree_choice(tree, manifest.limits.max_tree, num_heads)


def make_heads_drafter(name: str, bundle_dir: Path, manifest: BundleManifest, tree: str | None = None,
                       threads: int | None = None, chains: bool = False) -> HeadsDrafter:
    """``medusa``, ``cerberus`` (with its calibrated gate) or ``cerberus-nogate`` from the bundle."""
    from ..backends.ort import make_draft_session

    if name not in HEADS_DRAFTS:
        raise DraftMismatchError(f"Unknown heads draft '{name}'; choose one of {', '.join(HEADS_DRAFTS)}.")
    kind = "cerberus" if name.startswith("cerberus") else "medusa"
    entry = manifest.draft(kind)
    check_entry(entry, manifest)
    num_heads, topk = int(entry.setting("num_heads")), int(entry.setting("topk"))
    gate = gate_from_entry(entry, manifest.model.vocab_size) if name == "cerberus" else None

    spec, dynamic = resolve_tree(tree, entry, manifest, num_heads, chains)

    session = make_draft_session(Path(bundle_dir) / draft_graph(entry, kind).file)
    gate_session = None
    if gate is not None:
        gate_session = make_draft_session(Path(bundle_dir) / draft_graph(entry, f"{kind}-gate").file)
    return HeadsDrafter(kind, session, num_heads, topk, spec, dynamic, gate, gate_session)

