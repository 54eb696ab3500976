"""The draft graphs' contract: the one place their inputs and outputs are named and shaped.

:mod:`.contract` does this for the base step; this module does it for the three kinds of draft graph a
bundle can hold. The exporter traces each graph with these names (and marks these dimensions dynamic),
the drafters and calibrators feed them, and validation compares them.

- the **heads** graph (Medusa, Cerberus): ``hidden_states [batch, rows, hidden]`` in, each head's top-k
  ``topk_ids`` and ``topk_logprobs [batch, rows, heads, topk]`` out (ids best first, full vocabulary);
- the **gate** graph (Cerberus): ``hidden_states`` and the base ``logits [batch, rows, vocab]`` in,
  ``entropy`` and the learned gate's ``gate_prob [batch, rows]`` out;
- the **Chimera step** graph: one draft step with its own KV cache, written in place (``present_*`` are
  the ``past_*`` buffers); ``layer_states`` and ``from_layers`` only where the draft fuses base layers.

Dimensions are named: ``batch``, ``rows`` and ``capacity`` are dynamic (the exporter traces them as
such); the others (``hidden``, ``vocab``, ``heads``, ``topk``, ...) are fixed by the draft's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract import ATTENTION_MASK, HIDDEN_STATES, LAYER_STATES, LOGITS, POSITION_IDS, WRITE_INDICES

# Dynamic dimensions, by name.
BATCH, ROWS, CAPACITY = "batch", "rows", "capacity"
DYNAMIC_DIMS = (BATCH, ROWS, CAPACITY)

# Heads graph.
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"
# Gate graph.
ENTROPY = "entropy"
GATE_PROB = "gate_prob"
# Chimera step graph.
HIDDEN = "hidden"
FROM_LAYERS = "from_layers"
TRIGRAM_IDS = "trigram_ids"
BASE_HIDDEN = "base_hidden"
HEAD_INDEX = "head_index"
PAST_KEY, PAST_VALUE = "past_key", "past_value"
FEATURE = "feature"
PRESENT_KEY, PRESENT_VALUE = "present_key", "present_value"


@dataclass(frozen=True)
class Tensor:
    """One graph input or output: its name, dtype and dims (dynamic ones by name, fixed ones by config name)."""

    name: str
    dtype: str
    dims: tuple[str | int, ...]
    fused_only: bool = False  # present only where the draft fuses base layers (EAGLE-3 taps)

    def dynamic_axes(self) -> dict[int, str] | None:
        """``{axis: dynamic dim}``, or None where every dimension is fixed (as ``torch.export`` wants it)."""
        axes = {i: d for i, d in enumerate(self.dims) if d in DYNAMIC_DIMS}
        return axes or None


@dataclass(frozen=True)
class GraphContract:
    """A draft graph's inputs and outputs, in graph order."""

    name: str  # what the graph is (heads, gate, chimera-step); its bundle role is the kind's to name
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    def input_names(self, fused: bool = False) -> tuple[str, ...]:
        """The input names in order; ``fused``: with the fused-layer inputs."""
        return tuple(t.name for t in self.inputs if fused or not t.fused_only)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def dynamic_axes(self, fused: bool = False) -> dict[str, dict[int, str] | None]:
        """``{input: {axis: dim name}}`` of every input (None where fixed), for the exporter."""
        return {t.name: t.dynamic_axes() for t in self.inputs if fused or not t.fused_only}


HEADS = GraphContract(
    "heads",
    (Tensor(HIDDEN_STATES, "float32", (BATCH, ROWS, "hidden")),),
    (Tensor(TOPK_IDS, "int64", (BATCH, ROWS, "heads", "topk")),
     Tensor(TOPK_LOGPROBS, "float32", (BATCH, ROWS, "heads", "topk"))),
)

GATE = GraphContract(
    "gate",
    (Tensor(HIDDEN_STATES, "float32", (BATCH, ROWS, "hidden")), Tensor(LOGITS, "float32", (BATCH, ROWS, "vocab"))),
    (Tensor(ENTROPY, "float32", (BATCH, ROWS)), Tensor(GATE_PROB, "float32", (BATCH, ROWS))),
)

_KV = (BATCH, "kv_heads", CAPACITY, "head_dim")
CHIMERA_STEP = GraphContract(
    "chimera-step",
    (Tensor(HIDDEN, "float32", (BATCH, ROWS, "hidden")),
     Tensor(LAYER_STATES, "float32", (BATCH, ROWS, "taps_hidden"), fused_only=True),
     Tensor(FROM_LAYERS, "float32", (1,), fused_only=True),
     Tensor(TRIGRAM_IDS, "int64", (BATCH, ROWS, 3)),
     Tensor(POSITION_IDS, "int64", (BATCH, ROWS)),
     Tensor(ATTENTION_MASK, "float32", (BATCH, 1, ROWS, CAPACITY)),
     Tensor(WRITE_INDICES, "int64", (ROWS,)),
     Tensor(BASE_HIDDEN, "float32", (BATCH, "hidden")),
     Tensor(HEAD_INDEX, "int64", (1,)),
     Tensor(PAST_KEY, "float32", _KV),
     Tensor(PAST_VALUE, "float32", _KV)),
    (Tensor(FEATURE, "float32", (BATCH, "hidden")),
     Tensor(TOPK_IDS, "int64", (BATCH, "topk")),
     Tensor(TOPK_LOGPROBS, "float32", (BATCH, "topk")),
     Tensor(PRESENT_KEY, "float32", _KV),
     Tensor(PRESENT_VALUE, "float32", _KV)),
)
