"""TensorRT engines on disk and in the manifest (selection, build bookkeeping with a stand-in TensorRT), and
the one-line errors a machine without a GPU gives for the GPU commands and backends."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from specdeploy.exporter.cli import main
from specdeploy.runtime import backends
from specdeploy.runtime.backends.trt_profiles import (
    DeviceInfo,
    engine_dir_name,
    engine_file,
    select_engine,
)
from specdeploy.runtime.bundle import EngineEntry, read_manifest
from specdeploy.runtime.errors import BackendUnavailableError, BundleError

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()

H200 = DeviceInfo("NVIDIA H200", "9.0", "10.15.1.29")
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", "8.0", "10.3.0.26")


# --- engines on disk and in the manifest ----------------------------------------------------------------
def test_engine_paths():
    assert engine_dir_name(H200) == "nvidia-h200-sm90-trt10.15.1.29"
    assert engine_dir_name(A100) == "nvidia-a100-sxm4-80gb-sm80-trt10.3.0.26"
    assert engine_file(H200, "base", "fp16") == "engines/nvidia-h200-sm90-trt10.15.1.29/base-fp16.plan"


def _entry(device: DeviceInfo, precision: str, graph: str = "base") -> EngineEntry:
    return EngineEntry(graph, engine_file(device, graph, precision), device.gpu, device.compute_capability,
                       device.trt_version, precision)


def test_select_engine_one_sentence_errors():
    engines = [_entry(A100, "fp16"), _entry(H200, "fp32"), _entry(H200, "bf16")]
    assert select_engine(engines, "base", H200).precision == "bf16"  # preference: fp16 > bf16 > fp32
    assert select_engine(engines, "base", H200, "fp32").precision == "fp32"
    with pytest.raises(BundleError, match="no TensorRT engine for its 'chimera' graph"):
        select_engine(engines, "chimera", H200)
    newer = DeviceInfo("NVIDIA H200", "9.0", "10.16.0.1")
    with pytest.raises(BundleError) as err:
        select_engine(engines[:1], "base", newer)
    msg = str(err.value)
    assert "built for NVIDIA A100-SXM4-80GB (compute 8.0) with TensorRT 10.3.0.26" in msg
    assert "this machine has NVIDIA H200 (compute 9.0) with TensorRT 10.16.0.1" in msg
    assert msg.count(".") >= 1 and "\n" not in msg
    with pytest.raises(BundleError, match="no fp16 TensorRT engine for this GPU"):
        select_engine(engines, "base", H200, "fp16")


def test_build_bookkeeping_with_a_stand_in_tensorrt(tiny_bundle, tmp_path, monkeypatch):
    """Everything ``build`` does around TensorRT: paths, timing cache, manifest records, atomic update."""
    from specdeploy.exporter.build import trt as trt_build

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)

    class FakeTrt:
        __version__ = H200.trt_version

        class INetworkDefinition:
            pass

    calls = []

    def fake_build(trt, onnx_path, entry, profiles, config, timing, progress):
        calls.append((entry.role, [p.name for p in profiles], timing))
        return b"PLAN-" + config.precision.encode(), timing + b"+"

    monkeypatch.setattr(trt_build, "require_tensorrt", lambda: FakeTrt)
    monkeypatch.setattr(trt_build, "_device", lambda trt: H200)
    monkeypatch.setattr(trt_build, "_build_one", fake_build)
    lines: list[str] = []
    for precision in ("fp16", "fp32", "fp16"):  # the second fp16 build replaces the first
        trt_build.build_engines(bundle, trt_build.BuildConfig(precision, max_tree=16), progress=lines.append)
    manifest = read_manifest(bundle)  # still verifies: graphs untouched
    assert [(e.graph, e.precision) for e in manifest.engines] == [("base", "fp16"), ("base", "fp32")]
    for e in manifest.engines:
        assert (bundle / e.file).read_bytes() == b"PLAN-" + e.precision.encode()
        assert e.file.startswith(f"engines/{engine_dir_name(H200)}/")
    assert (bundle / "engines" / "timing.cache").read_bytes() == b"+++"  # persisted and reused
    assert [c[2] for c in calls] == [b"", b"+", b"++"]
    assert calls[0][1] == ["prefill", "tree"]
    assert any("KV write:" in ln and "KVCacheUpdate" in ln for ln in lines)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_build_failure_leaves_bundle_untouched(tiny_bundle, tmp_path, monkeypatch):
    from specdeploy.exporter.build import trt as trt_build

    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    before = (bundle / "manifest.json").read_text()

    def boom(*args, **kwargs):
        raise BundleError("TensorRT's ONNX parser rejects 'base.onnx': nope.")

    monkeypatch.setattr(trt_build, "require_tensorrt", lambda: type("T", (), {"__version__": "10.15",
                                                                               "INetworkDefinition": object}))
    monkeypatch.setattr(trt_build, "_device", lambda trt: H200)
    monkeypatch.setattr(trt_build, "_build_one", boom)
    with pytest.raises(BundleError, match="parser rejects"):
        trt_build.build_engines(bundle, trt_build.BuildConfig("fp16"), progress=lambda m: None)
    assert (bundle / "manifest.json").read_text() == before
    assert not (bundle / "engines").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


# --- one-line errors on a machine without a GPU ----------------------------------------------------------
def _one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    text = result.output.strip()
    assert "\n" not in text and "Traceback" not in text, text
    assert text.startswith("Error: ")
    for n in needles:
        assert n in text, text


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message")
def test_cli_build_without_gpu_is_one_line(tiny_bundle):
    r = CliRunner().invoke(main, ["build", str(tiny_bundle), "--precision", "fp16", "--max-tree", "16",
                                  "--max-context", "256", "--max-batch", "1"])
    if importlib.util.find_spec("tensorrt"):
        _one_line_error(r, "GPU")
    else:
        _one_line_error(r, "TensorRT is not installed")


def test_cli_build_rejects_limits_beyond_the_bundle(tiny_bundle):
    r = CliRunner().invoke(main, ["build", str(tiny_bundle), "--max-context", "100000"])
    _one_line_error(r, "--max-context 100000 exceeds the bundle's limit of 512")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU message")
@pytest.mark.parametrize("backend, needle", [("trt", "TensorRT"), ("ort-cuda", "CUDAExecutionProvider"),
                                             ("ort-trt", "TensorrtExecutionProvider")])
def test_cli_gpu_backends_without_gpu_are_one_line(tiny_bundle, backend, needle):
    r = CliRunner().invoke(main, ["validate", str(tiny_bundle), "--backend", backend])
    _one_line_error(r, needle)
    r = CliRunner().invoke(main, ["generate", str(tiny_bundle), "--prompt", "hi", "--backend", backend])
    _one_line_error(r, needle)


def test_torch_backends_are_plugins_named_in_the_package_metadata(tiny_bundle, monkeypatch):
    """The runtime finds the torch backends through entry points, imported only when chosen."""
    assert {"torch", "torch-eager", "torch-graphs"} <= set(backends.backend_names())
    engine_backend = backends.make_backend("torch-eager", tiny_bundle, read_manifest(tiny_bundle))
    assert type(engine_backend).__name__ == "TorchBackend"
    engine_backend.close()

    class Missing:  # a plugin whose package is not installed here
        name = "torch"

        def load(self):
            raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(backends, "_plugins", lambda: {"torch": Missing()})
    with pytest.raises(BackendUnavailableError, match="needs the package 'torch', which is not installed"):
        backends.make_backend("torch", tiny_bundle, read_manifest(tiny_bundle))
    with pytest.raises(BackendUnavailableError, match="Unknown backend 'nope'"):
        backends.make_backend("nope", tiny_bundle, read_manifest(tiny_bundle))


def test_runtime_imports_neither_torch_nor_exporter():
    code = ("import sys; import specdeploy.runtime.backends.trt, specdeploy.runtime.backends.ort, "
            "specdeploy.runtime.capture, specdeploy.runtime.backends as b; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('specdeploy.exporter', "
            "'specdeploy.graphs', 'tensorrt'))]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_validate_comparison_catches_a_drift(tiny_bundle):
    """The polygraphy comparison used by ``validate --backend``: ORT vs itself passes, a drift fails."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from specdeploy.exporter.check.trt import compare_runners, output_names, reference_feeds

    manifest = read_manifest(tiny_bundle)
    feeds = reference_feeds(tiny_bundle, manifest, capacity=256)
    path = str(tiny_bundle / "base.onnx")

    def ort_runner(name):
        return OnnxrtRunner(SessionFromOnnx(path, providers=["CPUExecutionProvider"]), name=name)

    names = output_names(manifest)
    checks = compare_runners(ort_runner("ref"), ort_runner("same"), feeds, "fp32", names)
    assert len(checks) == len(feeds) * len(names) and all(c.passed for c in checks)

    class Drifting(BaseRunner):
        def __init__(self):
            super().__init__(name="drifting")
            self.inner = ort_runner("inner")

        def activate_impl(self):
            self.inner.activate()

        def get_input_metadata_impl(self):
            return self.inner.get_input_metadata_impl()

        def infer_impl(self, feed_dict):
            out = self.inner.infer(feed_dict)
            self.inference_time = self.inner.last_inference_time()
            out["hidden_states"] = out["hidden_states"] + 0.05
            return out

        def deactivate_impl(self):
            self.inner.deactivate()

    checks = compare_runners(ort_runner("ref"), Drifting(), feeds, "fp32", names)
    failed = {(c.case, c.output) for c in checks if not c.passed}
    assert failed == {(case, "hidden_states") for case, _ in feeds}
    assert all(c.passed for c in compare_runners(ort_runner("ref"), Drifting(), feeds, "bf16", names))
