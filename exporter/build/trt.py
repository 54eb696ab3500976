"""``specdeploy build``: TensorRT engines for every TensorRT-target graph of a bundle.

What runs on a CPU (and is tested there): flag and limit checks, the optimization profiles
(:func:`specdeploy.runtime.backends.trt.optimization_profiles`), the lint, the engine paths and the
manifest bookkeeping (:func:`record_engines`). Everything after ``import tensorrt`` is UNTESTED on the
machines this project develops on (they have no GPU and no TensorRT); ``scripts/gpu_check.sh`` runs it
where TensorRT is installed.

Each engine gets two optimization profiles, prefill and tree decoding, with min/opt/max of batch,
T and capacity (the past-length axis of the cache), a workspace limit, and a timing cache persisted
at ``bundle/engines/timing.cache`` (reused across builds; a cache from another GPU is ignored and
replaced). Engines land in ``bundle/engines/<gpu>-sm<cc>-trt<version>/<graph>-<precision>.plan`` and are
recorded in the manifest. The whole update is staged in a copy of the bundle (hard links) and
renamed into place, so an interrupted build leaves the bundle as it was.

**In-place KV write: the graph's scatter, not KVCacheUpdate (decided, not measured).** TensorRT >= 10.15 has an
``IKVCacheUpdateLayer`` that writes new K/V rows into the cache in place (its output shares the
cache input's memory). We keep the exported graph's scatter (ScatterElements on the capacity axis;
ScatterND in older bundles) because:

1. KVCacheUpdate requires the cache's sequence axis to be *static*; our capacity is a dynamic
   dimension with doubling buckets, so one engine serves every bucket. Using the layer means one
   engine (and one set of profiles) per bucket.
2. It is reached either by network surgery after parsing (TensorRT has no API to remove the parsed
   scatter layers) or by re-exporting at opset 24 with ``TensorScatter`` and relying on the parser's
   mapping, which ORT CPU, the lint's opset range and our tests would all have to follow.
3. Nothing of it can be tested here.

The price of the scatter is one cache-sized copy per layer per step (its output is ``past`` with rows
scattered in). TensorRT does not promise that an output may alias an input, so the native backend
alternates two cache buffer sets instead of aliasing. On SmolLM2-135M with a 2k cache that copy is
~50 MB per step in fp32, tens of microseconds on an H100-class GPU. An fp16 (bf16) engine takes and
gives its ``past_*``/``present_*`` tensors in fp16 (bf16) (:func:`_reduce_kv_io`), which halves it; the
other inputs and outputs keep the graph's types. The build reports whether the installed
TensorRT has KVCacheUpdate, so the trade-off can be revisited with numbers from ``specdeploy bench``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdeploy.exporter.check.lint import lint_bundle
from specdeploy.exporter.export.staging import updated_bundle
from specdeploy.runtime.backends.trt import current_device, require_tensorrt
from specdeploy.runtime.backends.trt_profiles import DeviceInfo, Profile, engine_file, optimization_profiles
from specdeploy.runtime.bundle import BundleManifest, EngineEntry, GraphEntry, read_manifest, write_manifest
from specdeploy.runtime.contract import past_names, present_names
from specdeploy.runtime.errors import BackendUnavailableError, BundleError
from specdeploy.runtime.precision import BF16, ENGINE_PRECISIONS, FP16

Progress = Callable[[str], None]
TIMING_CACHE = "engines/timing.cache"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BuildConfig:
    precision: str = FP16
    max_tree: int | None = None  # None: the bundle's limit
    max_context: int | None = None
    max_batch: int | None = None
    workspace_gb: float = 4.0

    def __post_init__(self) -> None:
        if self.precision not in ENGINE_PRECISIONS:
            raise BundleError(f"Unknown precision '{self.precision}'; choose one of {', '.join(ENGINE_PRECISIONS)}.")
        if not self.workspace_gb > 0:
            raise BundleError(f"--workspace-gb must be positive; got {self.workspace_gb}.")


def buildable_graphs(manifest: BundleManifest) -> list[GraphEntry]:
    """Every graph meant for TensorRT (target 'trt'); ORT-only graphs (contrib ops) are skipped."""
    entries = list(manifest.graphs) + [g for d in manifest.drafts for g in d.graphs]
    return [g for g in entries if g.target == "trt"]


def record_engines(manifest: BundleManifest, new: Sequence[EngineEntry]) -> BundleManifest:
    """The manifest with ``new`` engines added, replacing any for the same graph, device and precision."""
    def key(e: EngineEntry) -> tuple[str, ...]:
        return (e.graph, e.gpu, e.compute_capability, e.trt_version, e.precision)

    replaced = {key(e) for e in new}
    kept = [e for e in manifest.engines if key(e) not in replaced]
    return manifest.replace(engines=tuple(sorted([*kept, *new], key=key)))


def check_lint(bundle_dir: Path) -> None:
    """Refuse to build graphs the lint rejects: the parser would fail later with a worse message."""
    issues = [i for g in lint_bundle(bundle_dir) for i in g.issues]
    if issues:
        more = f" (and {len(issues) - 1} more; run 'specdeploy lint')" if len(issues) > 1 else ""
        raise BundleError(f"The bundle fails the ONNX lint: {issues[0]}{more}.")


def build_engines(bundle_dir: str | Path, config: BuildConfig, progress: Progress = _stderr) -> list[EngineEntry]:
    """Build, write and record engines for every TensorRT graph of the bundle on this machine's GPU."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    profiles = optimization_profiles(manifest.limits, config.max_tree, config.max_context, config.max_batch)
    graphs = buildable_graphs(manifest)
    if not graphs:
        raise BundleError("The bundle has no graph meant for TensorRT (all are ONNX Runtime only).")
    check_lint(bundle_dir)
    trt = require_tensorrt()
    device = _device(trt)
    progress(f"building {len(graphs)} engine(s) for {device.describe()}, precision {config.precision}")
    for p in profiles:
        progress(f"  profile {p.name}: batch {p.batch.min}-{p.batch.max}, T {p.tree.min}-{p.tree.opt}-{p.tree.max}, "
                 f"capacity {p.capacity.min}-{p.capacity.opt}-{p.capacity.max}")
    has_kv_layer = hasattr(trt.INetworkDefinition, "add_kv_cache_update")
    kv_io = config.precision if config.precision in KV_IO_TYPES else "the graph's"
    progress(f"  KV write: the graph's scatter, two alternating cache buffers in {kv_io} precision (this TensorRT "
             f"{'has' if has_kv_layer else 'lacks'} KVCacheUpdate; see exporter/build/trt.py)")
    entries = []
    t0 = time.time()
    with updated_bundle(bundle_dir) as tmp:
        cache_path = tmp / TIMING_CACHE
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        timing = cache_path.read_bytes() if cache_path.is_file() else b""
        for i, g in enumerate(graphs, 1):
            progress(f"[{i}/{len(graphs)}] {g.role}: parsing {g.file} ...")
            plan, timing = _build_one(trt, tmp / g.file, g, profiles, config, timing, progress)
            rel = engine_file(device, g.role, config.precision)
            _write_atomic(tmp / rel, plan)
            progress(f"[{i}/{len(graphs)}] {g.role}: wrote {rel} ({len(plan) / 2**20:.1f} MiB, "
                     f"{time.time() - t0:.0f}s)")
            entries.append(EngineEntry(g.role, rel, device.gpu, device.compute_capability, device.trt_version,
                                       config.precision))
        _write_atomic(cache_path, timing)
        write_manifest(tmp, record_engines(read_manifest(tmp, verify=False), entries))
    progress(f"build complete ({time.time() - t0:.0f}s)")
    return entries


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _device(trt: Any) -> DeviceInfo:
    """This GPU via cuda-python, or via torch where only torch is installed (build only)."""
    try:
        return current_device(trt.__version__)
    except BackendUnavailableError as first:
        try:
            import torch
        except ImportError:
            raise first from None
        if not torch.cuda.is_available():
            raise BackendUnavailableError("No CUDA GPU is visible on this machine; TensorRT needs one.") from None
        major, minor = torch.cuda.get_device_capability(0)
        return DeviceInfo(torch.cuda.get_device_name(0), f"{major}.{minor}", trt.__version__)


# --- TensorRT proper (UNTESTED on this project's CPU machines) ---------------------------------------
def _progress_monitor(trt: Any, progress: Progress) -> Any:
    """Top-level builder phases as progress lines (TensorRT >= 10 has IProgressMonitor)."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.started: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                self.started[phase_name] = time.time()
                progress(f"    {phase_name} ({num_steps} steps) ...")

        def step_complete(self, phase_name, step):
            return True  # keep building

        def phase_finish(self, phase_name):
            if phase_name in self.started:
                progress(f"    {phase_name} done in {time.time() - self.started.pop(phase_name):.0f}s")

    return Monitor()


def _reduced_precision(trt: Any, builder_config: Any, precision: str, onnx_path: Path, workdir: Path
                       ) -> tuple[Path, bool]:
    """(ONNX file to parse, strongly typed?) for the precision.

    TensorRT 10 takes fp16/bf16 as builder flags on the fp32 graph. TensorRT 11 removed those flags:
    the graph is converted with ModelOpt AutoCast (I/O kept fp32) and built strongly typed.
    """
    if precision == "fp32":
        return onnx_path, False
    flag = getattr(trt.BuilderFlag, precision.upper(), None)
    if flag is not None:
        builder_config.set_flag(flag)
        return onnx_path, False
    try:
        import onnx
        from modelopt.onnx.autocast import convert_to_mixed_precision
    except ImportError:
        raise BackendUnavailableError(
            f"TensorRT {trt.__version__} builds {precision} only from a converted graph; install nvidia-modelopt "
            "(pip install 'nvidia-modelopt[onnx]') or build with --precision fp32."
        ) from None
    model = convert_to_mixed_precision(onnx_path=str(onnx_path), low_precision_type=precision, keep_io_types=True)
    out = workdir / f"{onnx_path.stem}-{precision}.onnx"
    onnx.save(model, str(out), save_as_external_data=True, location=out.name + ".data")
    return out, True


KV_IO_TYPES = {FP16: "float16", BF16: "bfloat16"}  # the TensorRT type of a reduced-precision engine's KV I/O


def kv_io_names(entry: GraphEntry) -> set[str]:
    """The graph's cache inputs and outputs (``past_*``, ``present_*``); a draft graph may have none."""
    n = len(entry.inputs) + len(entry.outputs)  # more layers than the graph can have
    return {s.name for s in (*entry.inputs, *entry.outputs)} & {*past_names(n), *present_names(n)}


def _reduce_kv_io(trt: Any, network: Any, names: set[str], precision: str, strongly_typed: bool) -> int:
    """Make the network's cache inputs and outputs fp16 (bf16) in linear layout; returns how many it changed.

    The parsed graph takes and gives fp32 K/V, so an fp16 engine would read and write twice the bytes
    its kernels use, and the runtime would keep an fp32 cache. A network input's type may be set in any
    network; an output's only in a weakly typed one (TensorRT 10's builder flags). A strongly typed
    network (TensorRT 11, the AutoCast graph) infers its types, so there the input is cast back to its
    graph type for the layers that read it and the output is a cast of the graph's output.
    """
    if precision not in KV_IO_TYPES:
        return 0
    kv_type = getattr(trt, KV_IO_TYPES[precision])
    linear = 1 << int(trt.TensorFormat.LINEAR)
    inputs = [t for t in (network.get_input(i) for i in range(network.num_inputs)) if t.name in names]
    outputs = [t for t in (network.get_output(i) for i in range(network.num_outputs)) if t.name in names]
    if strongly_typed:
        layers = [network.get_layer(i) for i in range(network.num_layers)]
        readers = [(layer, j, layer.get_input(j).name) for layer in layers for j in range(layer.num_inputs)
                   if layer.get_input(j) is not None and layer.get_input(j).name in names]
        for t in inputs:
            graph_type = t.dtype
            t.dtype = kv_type
            cast = network.add_cast(t, graph_type).get_output(0)
            for layer, j, name in readers:
                if name == t.name:
                    layer.set_input(j, cast)
        for i, t in enumerate(outputs):
            name = t.name
            network.unmark_output(t)
            t.name = f"{name}.{precision}_source"
            cast = network.add_cast(t, kv_type).get_output(0)
            cast.name = name
            network.mark_output(cast)
            outputs[i] = cast
    else:
        for t in (*inputs, *outputs):
            t.dtype = kv_type
    for t in (*inputs, *outputs):
        t.allowed_formats = linear
    return len(inputs) + len(outputs)


def _build_one(trt: Any, onnx_path: Path, entry: GraphEntry, profiles: Sequence[Profile], config: BuildConfig,
               timing: bytes, progress: Progress) -> tuple[bytes, bytes]:
    """Serialized engine and updated timing cache for one graph."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    bconfig = builder.create_builder_config()
    bconfig.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(config.workspace_gb * (1 << 30)))
    with tempfile.TemporaryDirectory(prefix="specdeploy-trt-") as work:
        path, strongly_typed = _reduced_precision(trt, bconfig, config.precision, onnx_path, Path(work))
        flags = 0
        if strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(path)):
            errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise BundleError(f"TensorRT's ONNX parser rejects '{entry.file}': {errs[0] if errs else 'unknown error'}.")
    kv = kv_io_names(entry)
    changed = _reduce_kv_io(trt, network, kv, config.precision, strongly_typed)
    if config.precision in KV_IO_TYPES and changed != len(kv):
        raise BundleError(f"TensorRT's parse of '{entry.file}' has {changed} of its {len(kv)} cache inputs "
                          "and outputs.")
    specs = {s.name: s for s in entry.inputs}
    for p in profiles:
        op = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            lo, opt, hi = p.shapes(specs[name])
            op.set_shape(name, lo, opt, hi)
        bconfig.add_optimization_profile(op)
    cache = bconfig.create_timing_cache(timing)
    if not bconfig.set_timing_cache(cache, ignore_mismatch=False):
        progress("    timing cache is from another GPU or TensorRT; starting a fresh one")
        bconfig.set_timing_cache(bconfig.create_timing_cache(b""), ignore_mismatch=False)
    monitor = _progress_monitor(trt, progress)
    if monitor is not None:
        bconfig.progress_monitor = monitor
    plan = builder.build_serialized_network(network, bconfig)
    if plan is None:
        raise BundleError(f"TensorRT failed to build an engine for '{entry.file}' (see the messages above).")
    return bytes(plan), bytes(bconfig.get_timing_cache().serialize())
