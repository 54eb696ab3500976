"""The bundle contract: ``manifest.json`` + ONNX graphs + tokenizer files in one directory.

The runtime reads only the bundle. The manifest is a versioned schema of frozen dataclasses; it
records the model config, every graph's I/O names, dtypes and dimension limits, package versions
and hashes of the weights, so a bundle that no longer matches its files is refused with one sentence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BundleError, DraftMismatchError
from .precision import GGUF_Q4_1_BLOCKS

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
TREE_TARGET = "ort-tree"  # the base graph whose rows attend in plain-step order (exact trees; batching)
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs to know about the base model (no torch, no transformers)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, element type and shape (ints or symbolic dimension names)."""

    name: str
    dtype: str  # numpy dtype name: "float32", "int64", ...
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class GraphEntry:
    """One ONNX graph in the bundle."""

    role: str  # "base" or "<draft kind>" / "<draft kind>-gate"
    file: str  # relative to the bundle directory
    sha: str  # blake2b of the .onnx file and its external data, see ``hash_files``
    data_files: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: int
    # "trt": standard ops only; "ort": may use ONNX Runtime contrib ops; TREE_TARGET: the "ort" graph whose rows
    # attend in plain-step order (exporter/export/ort_gathered.py). Other targets are ignored (older bundles'
    # "ort-batch", which this runtime no longer runs).
    target: str = "trt"
    precision: str = "fp32"
    # The fewest rows the graph's attention runs: 2 when it pads a 1-row step itself (the ``ort``
    # graph, see ``exporter/ort_graph.py``), which makes a 1-row step's attention row 0 of a 2-row
    # one. Informative only: whether steps are row-exact is measured at load (runtime/plan.py).
    attention_rows: int = 1
    # Base graphs: the decoder layers whose residual outputs come out as ``layer_states`` (contract.py).
    feature_layers: tuple[int, ...] = ()
    # Graphs written from a GGUF's blocks: (GGUF tensor, how it is held): its own format ("Q5_0", ...)
    # where its blocks were kept, "requantized-8bit" where they could not be.
    weight_blocks: tuple[tuple[str, str], ...] = ()
    # The gathered graph takes rows of several sequences, each at its own cache columns (runtime/rows.py): what
    # batching runs. False in bundles written before it could.
    rows_apart: bool = False


@dataclass(frozen=True)
class Limits:
    """Dimension limits the graphs and runtime are built for."""

    max_batch: int
    max_tree: int  # maximum T of a tree step
    max_context: int  # prompt + generated tokens


@dataclass(frozen=True)
class TokenizerInfo:
    file: str  # tokenizer.json, relative to the bundle
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool = False


@dataclass(frozen=True)
class SourceInfo:
    """Where the weights came from; ``weight_sha`` ties drafts to this exact base model."""

    path: str
    format: str  # "gguf" | "hf"
    weight_sha: str


@dataclass(frozen=True)
class DraftEntry:
    """A draft added by ``specdeploy export draft``; tied to the base by ``base_weight_sha``."""

    kind: str  # "chimera" | "cerberus" | "medusa"
    base_weight_sha: str
    weights_sha: str
    graphs: tuple[GraphEntry, ...]
    config: tuple[tuple[str, Any], ...] = ()  # kind-specific settings as sorted (key, value) pairs

    def setting(self, key: str, default: Any = None) -> Any:
        return dict(self.config).get(key, default)


@dataclass(frozen=True)
class EngineEntry:
    """A TensorRT engine built for one GPU and TensorRT version."""

    graph: str
    file: str
    gpu: str
    compute_capability: str
    trt_version: str
    precision: str


@dataclass(frozen=True)
class BundleManifest:
    model: ModelConfig
    graphs: tuple[GraphEntry, ...]
    limits: Limits
    tokenizer: TokenizerInfo
    source: SourceInfo
    versions: tuple[tuple[str, str], ...]
    kv_form: str = "inplace"  # "inplace": past buffers of capacity C written at write_indices
    drafts: tuple[DraftEntry, ...] = ()
    engines: tuple[EngineEntry, ...] = ()
    default_tree: str = "auto"
    schema_version: int = SCHEMA_VERSION

    def find_graph(self, role: str, target: str | None = None, precision: str | None = None) -> GraphEntry | None:
        """The first graph of ``role`` (with that target and precision, where given), or None."""
        return next((g for g in self.graphs if g.role == role and target in (None, g.target)
                     and precision in (None, g.precision)), None)

    @property
    def capacity_buckets(self) -> tuple[int, ...]:
        """The KV capacities a cache grows through (``kvcache.capacity_buckets`` of the limits)."""
        from .kvcache import capacity_buckets

        return capacity_buckets(self.limits.max_context, self.limits.max_tree)

    def base_files_without(self, feature_layers: tuple[int, ...]) -> list[str]:
        """The base graphs whose ``layer_states`` are not those layers' (what a fusing draft cannot run on)."""
        return [g.file for g in self.graphs if g.role == "base" and g.feature_layers != tuple(feature_layers)]

    def graph(self, role: str, target: str | None = None) -> GraphEntry:
        """The graph of ``role``; with ``target``, the one built for that target ("trt" or "ort")."""
        for g in self.graphs:
            if g.role == role and target in (None, g.target):
                return g
        if target is not None and any(g.role == role for g in self.graphs):
            have = ", ".join(g.target for g in self.graphs if g.role == role)
            raise BundleError(
                f"The bundle has no '{role}' graph for target '{target}' (it has: {have}); re-export it with "
                f"'specdeploy export base --target {target}' or '--target all'."
            )
        raise BundleError(f"The bundle has no '{role}' graph; it has: {', '.join(g.role for g in self.graphs)}.")

    def cpu_base(self, multi_row: bool = False) -> GraphEntry:
        """The base graph ONNX Runtime's CPU provider runs for 1-row steps, or for steps of more rows.

        Among the ``ort`` graphs, 1-row steps (plain decoding) take the GGUF-block graph
        (``gguf-q4_1``): it reads half the bytes. Steps of more rows (prefill, tree verification) take
        the other one (fp32 or a quantized precision): ONNX Runtime's 4-bit kernel dequantizes every
        weight for a step of more than one row, which makes a 16-node tree step on the GGUF-block
        graph cost ~3 plain steps. Both compute the same model on the same cache layout, so one
        backend runs each step on the graph that suits it (see ``OrtBackend``). Without an ``ort``
        graph, the traced standard-op graph.
        """
        ort = [g for g in self.graphs if g.role == "base" and g.target == "ort"]
        if not ort:
            return self.graph("base")
        wanted = [g for g in ort if (g.precision == GGUF_Q4_1_BLOCKS) != multi_row]
        return (wanted or ort)[0]

    def tree_graph(self) -> GraphEntry | None:
        """The base graph of exact trees (target ``TREE_TARGET``: each row's keys gathered in plain-step order),
        or None where the bundle has none (written before it had one)."""
        return self.find_graph("base", TREE_TARGET)

    def base_graph(self, prefer: str) -> GraphEntry:
        """The base graph of target ``prefer`` when the bundle has one, else its other base graph.

        ONNX Runtime's CPU provider prefers the ``ort`` graph (fused contrib kernels) and also runs the
        standard-op ``trt`` graph; the GPU providers prefer the standard-op graph.
        """
        try:
            return self.graph("base", prefer)
        except BundleError:
            return self.graph("base")

    def draft(self, kind: str) -> DraftEntry:
        for d in self.drafts:
            if d.kind == kind:
                return d
        have = ", ".join(d.kind for d in self.drafts) or "none"
        raise DraftMismatchError(
            f"The bundle has no '{kind}' draft (it has: {have}); add one with "
            f"'specdeploy export draft --kind {kind}'."
        )

    def replace(self, **changes: Any) -> BundleManifest:
        return dataclasses.replace(self, **changes)

    # --- JSON round trip -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BundleManifest:
        raw = json.loads(text)
        version = raw.get("schema_version")
        if not isinstance(version, int):
            raise BundleError("The bundle manifest has no integer schema_version.")
        if version > SCHEMA_VERSION:
            raise BundleError(
                f"The bundle was written with manifest schema {version}, newer than this "
                f"specdeploy supports ({SCHEMA_VERSION}); upgrade specdeploy or re-export the bundle."
            )
        try:
            return _build(cls, raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"The bundle manifest is malformed ({exc}).") from None


def _build(cls: type, raw: Any) -> Any:
    """Rebuild nested frozen dataclasses (and tuples) from ``json.loads`` output."""
    hints = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, f in hints.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise KeyError(f"missing field '{name}' in {cls.__name__}")
            continue
        kwargs[name] = _convert(f.type, raw[name])
    return cls(**kwargs)


_NESTED = {
    "ModelConfig": ModelConfig,
    "GraphEntry": GraphEntry,
    "TensorSpec": TensorSpec,
    "Limits": Limits,
    "TokenizerInfo": TokenizerInfo,
    "SourceInfo": SourceInfo,
    "DraftEntry": DraftEntry,
    "EngineEntry": EngineEntry,
}


def _convert(type_str: Any, value: Any) -> Any:
    t = str(type_str)
    for name, klass in _NESTED.items():
        if t == name:
            return _build(klass, value)
        if t.startswith("tuple[") and name in t and isinstance(value, list):
            return tuple(_build(klass, v) for v in value)
    if isinstance(value, list):
        return tuple(_convert("tuple", v) if isinstance(v, list) else v for v in value)
    return value


# --- files ------------------------------------------------------------------------------------
def hash_files(paths: list[Path]) -> str:
    """blake2b over the files' bytes, in order (fast enough to check at every load)."""
    h = hashlib.blake2b(digest_size=20)
    for p in paths:
        with open(p, "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def graph_paths(bundle_dir: Path, entry: GraphEntry) -> list[Path]:
    return [bundle_dir / entry.file, *(bundle_dir / f for f in entry.data_files)]


def read_manifest(bundle_dir: str | os.PathLike, verify: bool = True) -> BundleManifest:
    """Load a bundle's manifest; with ``verify``, check every listed file exists and matches its hash."""
    bundle_dir = Path(bundle_dir)
    if not bundle_dir.is_dir():
        raise BundleError(f"No bundle directory at '{bundle_dir}'.")
    path = bundle_dir / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"'{bundle_dir}' is not a bundle: it has no {MANIFEST_NAME}.")
    try:
        manifest = BundleManifest.from_json(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"The bundle manifest '{path}' is not valid JSON ({exc.msg}).") from None
    if verify:
        verify_bundle_files(bundle_dir, manifest)
    return manifest


def verify_bundle_files(bundle_dir: Path, manifest: BundleManifest) -> None:
    entries = list(manifest.graphs) + [g for d in manifest.drafts for g in d.graphs]
    for entry in entries:
        paths = graph_paths(bundle_dir, entry)
        for p in paths:
            if not p.is_file():
                raise BundleError(f"The bundle is incomplete: '{p.name}' is listed in the manifest but missing.")
        if hash_files(paths) != entry.sha:
            raise BundleError(
                f"The bundle is corrupt: the weights of graph '{entry.file}' do not match the hash in "
                "the manifest; re-export it."
            )
    tok = bundle_dir / manifest.tokenizer.file
    if not tok.is_file():
        raise BundleError(f"The bundle is incomplete: tokenizer file '{manifest.tokenizer.file}' is missing.")


def write_manifest(bundle_dir: Path, manifest: BundleManifest) -> None:
    tmp = bundle_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, bundle_dir / MANIFEST_NAME)


def config_pairs(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Freeze a kind-specific settings dict into sorted pairs for :class:`DraftEntry`."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


__all__ = [
    "SCHEMA_VERSION",
    "BundleManifest",
    "DraftEntry",
    "EngineEntry",
    "GraphEntry",
    "Limits",
    "ModelConfig",
    "SourceInfo",
    "TensorSpec",
    "TokenizerInfo",
    "config_pairs",
    "graph_paths",
    "hash_files",
    "read_manifest",
    "verify_bundle_files",
    "write_manifest",
]
