"""``specdeploy validate|lint|build``: a bundle checked against torch, its graphs linted, TensorRT engines built."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from specdeploy.exporter.cli.options import SOURCE_MODEL_OPTION
from specdeploy.runtime.precision import ENGINE_PRECISIONS, FP16


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@SOURCE_MODEL_OPTION
@click.option("--backend", "backend", default="ort-cpu", show_default=True,
              type=click.Choice(["ort-cpu", "trt", "ort-cuda", "ort-trt"]),
              help="ort-cpu: torch vs ONNX Runtime; trt/ort-cuda/ort-trt: that GPU backend vs ONNX Runtime CPU.")
def validate(bundle: Path, model: str | None, backend: str) -> None:
    """Compare torch with ONNX Runtime on prefill, step and tree cases; ends with PASSED or FAILED.

    \b
    With --backend trt, every TensorRT engine built for this GPU is compared with ONNX Runtime on the
    CPU (polygraphy runners, per-output tolerances per precision).
    """
    from specdeploy.exporter.check.validate import validate_bundle
    from specdeploy.runtime.errors import ValidationFailed

    try:
        if backend == "ort-cpu":
            validate_bundle(bundle, model, progress=click.echo)
        else:
            from specdeploy.exporter.check.trt import validate_backend

            validate_backend(bundle, backend, progress=click.echo)
    except ValidationFailed as exc:
        click.echo(f"FAILED: {exc}")
        sys.exit(1)
    click.echo("PASSED")


# --- lint / build (GPU path) ------------------------------------------------------------------
@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def lint(bundle: Path) -> None:
    """Check every graph against what TensorRT's parser and ORT CUDA graphs accept; ends with PASSED or FAILED.

    \b
    Rules: opset range, standard domain only, no If/Loop/Scan, no sequences, no data-dependent
    output shapes. Every offending node is listed with the rule it breaks.

    \b
    Example:
      specdeploy lint bundles/smollm2
    """
    from specdeploy.exporter.check.lint import lint_bundle

    results = lint_bundle(bundle)
    for g in results:
        state = f"skipped: {g.skipped}" if g.skipped else ("ok" if g.passed else f"{len(g.issues)} issue(s)")
        click.echo(f"{g.role:<15}{g.file:<28}{state}")
        for issue in g.issues:
            click.echo(f"  {issue}")
    if all(g.passed for g in results):
        click.echo("PASSED")
    else:
        click.echo("FAILED")
        sys.exit(1)


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--precision", default=FP16, show_default=True, type=click.Choice(ENGINE_PRECISIONS))
@click.option("--max-tree", type=int, default=None, help="Largest tree step T (default: the bundle's limit).")
@click.option("--max-context", type=int, default=None, help="Longest context (default: the bundle's limit).")
@click.option("--max-batch", type=int, default=None, help="Largest batch (default: the bundle's limit).")
@click.option("--workspace-gb", type=float, default=4.0, show_default=True, help="TensorRT workspace limit.")
def build(bundle: Path, precision: str, max_tree: int | None, max_context: int | None, max_batch: int | None,
          workspace_gb: float) -> None:
    """Build TensorRT engines for this GPU into BUNDLE/engines/ and record them in the manifest.

    Needs an NVIDIA GPU and the tensorrt package. Prefill and tree decoding get their own optimization
    profiles; the timing cache persists in BUNDLE/engines/timing.cache.

    \b
    Example:
      specdeploy build bundles/smollm2 --precision fp16 --max-tree 64 --max-context 2048
    """
    from specdeploy.exporter.build.trt import BuildConfig, build_engines

    config = BuildConfig(precision, max_tree, max_context, max_batch, workspace_gb)
    entries = build_engines(bundle, config, progress=lambda m: click.echo(m, err=True))
    for e in entries:
        click.echo(f"built {e.file}")
