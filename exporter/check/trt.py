"""``specdeploy validate --backend trt|ort-cuda|ort-trt``: a GPU backend against ONNX Runtime on the CPU.

Polygraphy runners and the Comparator do the work: the ORT CPU runner is the reference, the same
feeds (prefill, one-token step, branching tree step; :func:`specdeploy.exporter.check.validate.base_cases`)
go to both, and ``CompareFunc.simple`` checks every output against its own tolerance for the engine's
precision; logits must also agree on the argmax. For TensorRT every engine this GPU may load is
checked, under each optimization profile whose ranges hold the feeds. All failures are collected,
then one :class:`ValidationFailed` lists them.

The comparison itself runs on a CPU (tests compare ORT CPU with itself); the GPU runners are UNTESTED
on this project's CPU machines and raise one clear sentence there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.exporter.check.validate import OutputCheck, base_cases, report
from specdeploy.runtime.backends.trt import current_device, engine_profiles, require_tensorrt
from specdeploy.runtime.bundle import BundleManifest, read_manifest
from specdeploy.runtime.errors import BackendUnavailableError, ValidationFailed
from specdeploy.runtime.text import TextCodec

GPU_BACKENDS = ("trt", "ort-cuda", "ort-trt")
# Per precision: max |delta| allowed for logits, hidden states and the written KV cache.
# Provisional: fp32 follows validate.py; fp16/bf16 allow their ~1e-3 / ~8e-3 relative rounding
# accumulated over the layers. Revisit with the numbers gpu_check.sh reports.
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"logits": 1e-3, "hidden_states": 1e-2, "present": 1e-2},
    "fp16": {"logits": 5e-2, "hidden_states": 1e-1, "present": 5e-2},
    "bf16": {"logits": 2.5e-1, "hidden_states": 5e-1, "present": 2.5e-1},
}
PROMPT = "The quick brown fox jumps over the lazy dog. Speculative decoding"


def tolerances(precision: str, output_names: Sequence[str]) -> dict[str, float]:
    """Per-output atol for ``precision`` (present_* outputs share one)."""
    tol = TOLERANCES[precision]
    return {n: tol["present"] if n.startswith("present_") else tol[n] for n in output_names}


def output_names(manifest: BundleManifest) -> list[str]:
    m = manifest.model
    return ["logits", "hidden_states", *(f"present_{k}_{i}" for i in range(m.num_layers) for k in ("key", "value"))]


def reference_feeds(bundle_dir: Path, manifest: BundleManifest, capacity: int) -> list[tuple[str, dict]]:
    """Prefill, step and tree feeds whose cache comes from an ORT CPU prefill."""
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(str(bundle_dir / manifest.graph("base", "trt").file), providers=["CPUExecutionProvider"])

    def step_fn(**kw: torch.Tensor) -> list[torch.Tensor]:
        return [torch.from_numpy(o) for o in sess.run(None, {k: v.numpy() for k, v in kw.items()})]

    ids = TextCodec.for_bundle(bundle_dir, manifest).encode(PROMPT)[:16]
    return base_cases(manifest, step_fn, ids, capacity=capacity)


def compare_runners(reference: Any, runner: Any, feeds: Sequence[tuple[str, dict]], precision: str,
                    names: Sequence[str], label: str = "") -> list[OutputCheck]:
    """Run both polygraphy runners on the feeds and check every output with per-output tolerances."""
    from polygraphy import comparator
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    atol = tolerances(precision, names)
    results = comparator.Comparator.run([reference, runner], data_loader=[f for _, f in feeds])
    simple = getattr(comparator, "SimpleCompareFunc", None) or comparator.CompareFunc.simple  # older polygraphy
    compare = simple(atol=atol, rtol=dict.fromkeys(names, 0.0), check_error_stat="max")
    accuracy = comparator.Comparator.compare_accuracy(results, compare_func=compare)
    per_iter = next(iter(accuracy[0].values()))  # one compare function, one runner pair
    ref_out, got_out = results[0][1], results[1][1]
    checks = []
    for (case, _), cmp, a, b in zip(feeds, per_iter, ref_out, got_out):
        for name in names:
            agree = bool((np.asarray(a[name]).argmax(-1) == np.asarray(b[name]).argmax(-1)).all()) \
                if name == "logits" else None
            checks.append(OutputCheck(f"{label}{case}", name, float(cmp[name].max_absdiff), atol[name], agree))
    return checks


def _ort_runner(path: Path, provider: str, name: str) -> Any:
    import onnxruntime as ort
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    if provider not in ort.get_available_providers():
        raise BackendUnavailableError(
            f"ONNX Runtime's {provider} is not available on this machine; it needs a GPU and onnxruntime-gpu."
        )
    return OnnxrtRunner(SessionFromOnnx(str(path), providers=[provider]), name=name)


def _fits(profile, feed: dict) -> bool:
    b, t = feed["input_ids"].shape
    return profile.contains(b, t, feed["attention_mask"].shape[3], len(feed["logits_index"]))


def _trt_runners(bundle_dir: Path, manifest: BundleManifest, feeds) -> list[tuple[str, str, Any, list]]:
    """(label, precision, runner, feeds) per engine for this GPU and per profile the feeds fit."""
    trt = require_tensorrt()
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    device = current_device(trt.__version__)
    from specdeploy.runtime.backends.trt_profiles import select_engine

    select_engine(manifest.engines, "base", device)  # one clear sentence when none fits this machine
    out = []
    for e in manifest.engines:
        if e.graph != "base" or (e.gpu, e.compute_capability, e.trt_version) != (
                device.gpu, device.compute_capability, device.trt_version):
            continue
        data = (bundle_dir / e.file).read_bytes()
        engine = trt.Runtime(trt.Logger(trt.Logger.ERROR)).deserialize_cuda_engine(data)
        if engine is None:
            raise ValidationFailed(f"TensorRT cannot load '{e.file}'; rebuild it with 'specdeploy build'.")
        for i, profile in enumerate(engine_profiles(engine)):
            fitting = [(c, f) for c, f in feeds if _fits(profile, f)]
            if fitting:
                runner = TrtRunner(EngineFromBytes(data), name=f"trt-{e.precision}-{profile.name}",
                                   optimization_profile=i)
                out.append((f"{e.precision}/{profile.name}/", e.precision, runner, fitting))
    return out


def validate_backend(bundle_dir: str | Path, backend: str, progress: Callable[[str], None] = print
                     ) -> list[OutputCheck]:
    """Compare ``backend`` with ORT CPU; raises ValidationFailed listing every failed check."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    if backend not in GPU_BACKENDS:
        raise BackendUnavailableError(f"validate compares {', '.join(GPU_BACKENDS)} with ONNX Runtime, not '{backend}'.")
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    onnx_path = bundle_dir / manifest.graph("base", "trt").file
    names = output_names(manifest)
    if backend == "trt":
        require_tensorrt()  # fail with one sentence before any work
    else:
        _ort_runner(onnx_path, {"ort-cuda": "CUDAExecutionProvider", "ort-trt": "TensorrtExecutionProvider"}[backend],
                    backend)
    feeds = reference_feeds(bundle_dir, manifest, manifest.capacity_buckets[0])
    reference = OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]), name="ort-cpu")
    if backend == "trt":
        targets = _trt_runners(bundle_dir, manifest, feeds)
    else:
        provider = {"ort-cuda": "CUDAExecutionProvider", "ort-trt": "TensorrtExecutionProvider"}[backend]
        targets = [("", "fp32", _ort_runner(onnx_path, provider, backend), feeds)]
    checks: list[OutputCheck] = []
    for label, precision, runner, fitting in targets:
        progress(f"comparing {runner.name} with ONNX Runtime CPU on {', '.join(c for c, _ in fitting)} ...")
        checks += compare_runners(reference, runner, fitting, precision, names, label)
    shown = [c for c in checks if c.output in ("logits", "hidden_states") or not c.passed]
    report(shown, progress)
    failed = [c for c in checks if not c.passed]
    if failed:
        detail = "; ".join(f"{c.case}/{c.output} max|delta| {c.max_abs:.2e}" for c in failed[:8])
        raise ValidationFailed(f"{len(failed)} check(s) failed: {detail}.")
    return checks
