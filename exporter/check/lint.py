"""``specdeploy lint``: check exported graphs against what TensorRT's ONNX parser and ORT CUDA graphs accept.

Runs in CI on every exported graph; it needs only ``onnx`` (the weights are not loaded). Rules:

``opset``
    The default-domain opset must lie in ``[MIN_OPSET, MAX_OPSET]``. 13 is the oldest opset whose
    Split/Squeeze/Unsqueeze/ReduceSum take their sizes and axes as inputs, which is the form both
    the dynamo exporter and TensorRT's parser work in; 24 is the newest that TensorRT 10.15+ and
    ONNX Runtime >= 1.23 both parse (it is also where ``TensorScatter``, the in-place KV write of
    the design notes, first exists).
``standard-domain``
    Every node is in the standard ``ai.onnx`` domain: no ``com.microsoft`` contrib ops, no
    ``ai.onnx.ml``, no custom domains. Local functions are inlined first, so a call to one is
    judged by the nodes it expands to.
``control-flow``
    No ``If``/``Loop``/``Scan`` (or any node that carries a subgraph): ORT's CUDA-graph capture
    needs a static kernel sequence and TensorRT's parser rejects most control flow.
``sequence-type``
    No sequence or optional values (``SequenceConstruct``, ``SplitToSequence``, ``Optional``...):
    TensorRT has tensors only.
``data-dependent-shape`` (step graphs only)
    Every output shape must follow from the *shapes* of the inputs, never from their *values*, so a
    captured CUDA graph of a given (batch, T, capacity) is valid for every step with those shapes.
    Concretely, a node breaks the rule if

    * it is ``NonZero``, ``Unique``, ``Compress`` or ``NonMaxSuppression`` (output size is a count of
      data), or
    * one of its shape-determining inputs (``Reshape``'s shape, ``Expand``'s shape, ``Tile``'s
      repeats, ``ConstantOfShape``'s input, ``Range``'s start/limit/delta, ``TopK``'s k, ``Slice``'s
      starts/ends/axes/steps, ``Pad``'s pads, ``Resize``'s scales/sizes, ``OneHot``'s depth,
      ``Split``'s sizes, ``Squeeze``/``Unsqueeze``/``Reduce*`` axes) carries *values* of a graph
      input. A tensor carries values of a graph input if it is that input or is computed from one,
      except through ``Shape`` and ``Size``, whose outputs depend on shapes only. Initializers and
      ``Constant`` outputs carry no input values. So ``Reshape(x, Concat(Shape(x)[0], -1))`` passes
      and ``TopK(x, k=ReduceMax(ids))`` or ``Range(0, Gather(position_ids, 0), 1)`` fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.errors import BundleError

MIN_OPSET = 13
MAX_OPSET = 24
STANDARD_DOMAINS = ("", "ai.onnx")

RULE_OPSET = "opset"
RULE_DOMAIN = "standard-domain"
RULE_CONTROL_FLOW = "control-flow"
RULE_SEQUENCE = "sequence-type"
RULE_DATA_SHAPE = "data-dependent-shape"
RULES = (RULE_OPSET, RULE_DOMAIN, RULE_CONTROL_FLOW, RULE_SEQUENCE, RULE_DATA_SHAPE)

CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
SEQUENCE_OPS = frozenset({
    "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase", "SequenceAt", "SequenceLength",
    "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement", "OptionalHasElement",
})
DATA_SIZED_OPS = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})
_REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
# op type -> indices of inputs that decide the output's shape (rank or sizes).
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2), "TopK": (1,),
    "Slice": (1, 2, 3, 4), "Pad": (1,), "Resize": (2, 3), "Upsample": (1,), "OneHot": (1,), "Split": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "CenterCropPad": (1,), **{op: (1,) for op in _REDUCE_OPS},
}
SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})  # outputs depend on the input's shape, never its values


@dataclass(frozen=True)
class LintIssue:
    """One node (or the model itself, node ``<model>``) breaking one rule."""

    graph: str  # file name
    node: str
    op_type: str
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.graph}: node '{self.node}' ({self.op_type}) breaks rule '{self.rule}': {self.detail}"


@dataclass(frozen=True)
class GraphLint:
    """The lint result of one bundle graph; ``skipped`` says why a graph was not linted."""

    role: str
    file: str
    issues: tuple[LintIssue, ...]
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return not self.issues


def lint_model(model, name: str = "model.onnx", step_graph: bool = True,
               opset_range: tuple[int, int] = (MIN_OPSET, MAX_OPSET)) -> list[LintIssue]:
    """Lint an in-memory ``onnx.ModelProto`` (weights need not be loaded)."""
    from onnx import AttributeProto, inliner

    issues: list[LintIssue] = []

    def add(node: str, op: str, rule: str, detail: str) -> None:
        issues.append(LintIssue(name, node, op, rule, detail))

    lo, hi = opset_range
    opset = next((o.version for o in model.opset_import if o.domain in STANDARD_DOMAINS), None)
    if opset is None:
        add("<model>", "-", RULE_OPSET, "the model imports no default-domain (ai.onnx) opset.")
    elif not lo <= opset <= hi:
        add("<model>", "-", RULE_OPSET, f"default-domain opset {opset} is outside the supported range {lo}..{hi}.")

    if model.functions:
        model = inliner.inline_local_functions(model)
    graph = model.graph
    # Tensors that carry values of a graph input (see the module docstring).
    initializers = {t.name for t in graph.initializer}
    data = {i.name for i in graph.input}  # an input that shadows an initializer is still an input
    for idx, node in enumerate(graph.node):
        label = node.name or f"<unnamed #{idx}>"
        op = node.op_type
        if node.domain not in STANDARD_DOMAINS:
            add(label, op, RULE_DOMAIN, f"op domain '{node.domain}' is not the standard ai.onnx domain.")
        if op in CONTROL_FLOW_OPS or any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
                                         for a in node.attribute):
            add(label, op, RULE_CONTROL_FLOW, f"{op} is control flow; TensorRT and ORT CUDA graphs need none.")
        if op in SEQUENCE_OPS:
            add(label, op, RULE_SEQUENCE, f"{op} produces a sequence/optional value; only tensors are allowed.")
        if step_graph and node.domain in STANDARD_DOMAINS:
            if op in DATA_SIZED_OPS:
                add(label, op, RULE_DATA_SHAPE, f"{op}'s output size depends on the input values.")
            for i in SHAPE_INPUTS.get(op, ()):
                if i < len(node.input) and node.input[i] in data:
                    add(label, op, RULE_DATA_SHAPE,
                        f"input {i} ('{node.input[i]}') decides the output shape but is computed from graph "
                        "input values.")
        if op in SHAPE_ONLY_OPS:
            continue
        if any(x in data for x in node.input if x and x not in initializers):
            data.update(o for o in node.output if o)
    return issues


def lint_graph(path: str | Path, step_graph: bool = True,
               opset_range: tuple[int, int] = (MIN_OPSET, MAX_OPSET)) -> list[LintIssue]:
    """Lint one ONNX file; returns every issue found (empty when it passes)."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise BundleError(f"No ONNX graph at '{path}'.")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError) as exc:
        raise BundleError(f"'{path.name}' is not a readable ONNX model ({str(exc).splitlines()[0][:160]}).") from None
    return lint_model(model, path.name, step_graph, opset_range)


def lint_bundle(bundle_dir: str | Path) -> list[GraphLint]:
    """Lint every graph of a bundle that is meant for TensorRT (target 'trt'); all bundle graphs are step graphs."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir, verify=False)
    entries = list(manifest.graphs) + [g for d in manifest.drafts for g in d.graphs]
    out = []
    for g in entries:
        if g.target != "trt":
            out.append(GraphLint(g.role, g.file, (), skipped=f"target '{g.target}' (ONNX Runtime only)"))
            continue
        out.append(GraphLint(g.role, g.file, tuple(lint_graph(bundle_dir / g.file, step_graph=True))))
    return out
