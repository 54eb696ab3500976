"""The base step's contract: the one place its graph inputs and outputs are named and shaped.

Every base graph of a bundle (the traced ``trt`` graph and the op-by-op ``ort`` graph, at any
precision) has exactly these inputs and outputs. The exporter writes graphs from this module, the
manifest records what each graph has, and the backends bind these names.

- ``input_ids``, ``position_ids`` ``[batch, tree]``: a tree node sits at past length + depth;
- ``attention_mask`` ``[batch, 1, tree, capacity]``: 0 where a row sees a slot, the dtype minimum elsewhere;
- ``write_indices`` ``[tree]``: the cache slots the step's K/V rows are written to (contiguous); in a
  graph that takes rows of several sequences (the exact-tree graph, ``GraphEntry.rows_apart``) row 0's, and
  row b's are shifted by ``position_ids[b, 0] - position_ids[0, 0]``, so that each sequence of a batch keeps
  its tokens at the columns they hold alone;
- ``logits_index`` ``[kept]``: the rows whose logits come back;
- ``past_{key,value}_{layer}`` ``[batch, kv_heads, capacity, head_dim]``, written in place;
- outputs ``logits`` ``[batch, kept, vocab]``, ``hidden_states`` ``[batch, tree, hidden]`` (the lm_head
  input, which the drafts read) and ``present_{key,value}_{layer}`` (the same buffers as ``past``);
- optionally ``layer_states`` ``[batch, tree, taps * hidden]``: the residual outputs of the decoder layers a
  graph was exported to tap (its ``specdeploy.feature_layers`` metadata), side by side, for drafts that
  fuse low, mid and high features (EAGLE-3).
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
WRITE_INDICES = "write_indices"
LOGITS_INDEX = "logits_index"
LOGITS = "logits"
HIDDEN_STATES = "hidden_states"
LAYER_STATES = "layer_states"
FEATURE_LAYERS_KEY = "specdeploy.feature_layers"  # model metadata: the tapped layers, e.g. "1,14,26"

# Dynamic dimensions, by name.
BATCH, TREE, CAPACITY, KEPT = "batch", "tree", "capacity", "kept"

# (name, dtype, dims) of the step inputs before the cache.
STEP_INPUTS: tuple[tuple[str, str, tuple], ...] = (
    (INPUT_IDS, "int64", (BATCH, TREE)),
    (POSITION_IDS, "int64", (BATCH, TREE)),
    (ATTENTION_MASK, "float32", (BATCH, 1, TREE, CAPACITY)),
    (WRITE_INDICES, "int64", (TREE,)),
    (LOGITS_INDEX, "int64", (KEPT,)),
)
INPUT_NAMES = tuple(name for name, _, _ in STEP_INPUTS)


def step_outputs(vocab_size: int, hidden_size: int, taps: int = 0) -> tuple[tuple[str, str, tuple], ...]:
    """(name, dtype, dims) of the step outputs before the cache (``taps`` tapped layers add ``layer_states``)."""
    out = ((LOGITS, "float32", (BATCH, KEPT, vocab_size)), (HIDDEN_STATES, "float32", (BATCH, TREE, hidden_size)))
    if taps:
        out += ((LAYER_STATES, "float32", (BATCH, TREE, taps * hidden_size)),)
    return out


def parse_feature_layers(value: str | None) -> tuple[int, ...]:
    """The tapped layers from a graph's ``FEATURE_LAYERS_KEY`` metadata ("" or None: none)."""
    return tuple(int(v) for v in value.split(",")) if value else ()


def kv_dims(num_kv_heads: int, head_dim: int) -> tuple:
    return (BATCH, num_kv_heads, CAPACITY, head_dim)


def past_names(num_layers: int) -> list[str]:
    """``past_key_0, past_value_0, past_key_1, ...``: the cache inputs, layer by layer."""
    return [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    """``present_key_0, present_value_0, ...``: the cache outputs, bound to the same buffers as ``past``."""
    return [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
