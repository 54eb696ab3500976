"""Writing bundles safely: staging directories renamed into place, and the ONNX graph entry of each file.

A new bundle is written into a temporary sibling directory and renamed at the end; an update stages a
hard-linked copy. Ctrl-C, an error or a full disk leaves nothing half-written.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdeploy.exporter.export.ort_graph import ATTENTION_ROWS_KEY, ROWS_APART_KEY, WEIGHT_BLOCKS_KEY
from specdeploy.runtime import contract
from specdeploy.runtime.bundle import GraphEntry, TensorSpec, hash_files
from specdeploy.runtime.errors import BundleError, BundleExistsError

# Pinned opset: 18 is what TensorRT's parser and ORT's CUDA EP both handle well for these ops.
OPSET = 18


def _staging_dir(dest: Path) -> Path:
    """A private temporary directory next to ``dest``, made world-readable like a normal directory
    (mkdtemp creates it 0700, and the rename would carry that mode over to the bundle)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)
    return tmp


def _disk_full(exc: BaseException, dest: Path) -> BundleError | None:
    """The one-sentence error for a write that ran out of disk space, or None for any other error."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    try:
        free = shutil.disk_usage(dest.parent).free / 2**30
    except OSError:
        return BundleError(f"The disk ran out of space while writing '{dest}'; nothing was kept.")
    return BundleError(f"The disk ran out of space while writing '{dest}' ({free:.1f} GiB free now that "
                       "the partial files are removed); free some space or write the bundle elsewhere.")


@contextmanager
def _swapped_in(tmp: Path, dest: Path) -> Iterator[Path]:
    """Yield ``tmp``; on success it atomically becomes ``dest``, on any failure it is removed."""
    try:
        yield tmp
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = _disk_full(exc, dest)
        if full is not None:
            raise full from exc
        raise


@contextmanager
def staged_bundle(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it atomically becomes ``out``."""
    out = Path(out)
    if out.exists() and not force:
        raise BundleExistsError(f"'{out}' already exists; pass --force to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _swapped_in(_staging_dir(out), out) as tmp:
        yield tmp


@contextmanager
def updated_bundle(bundle: Path) -> Iterator[Path]:
    """Stage a copy of an existing bundle (hard links for big files) to add graphs to it atomically."""
    bundle = Path(bundle)
    with _swapped_in(_staging_dir(bundle), bundle) as tmp:
        for src in bundle.rglob("*"):
            dst = tmp / src.relative_to(bundle)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        yield tmp


def package_versions(*names: str) -> tuple[tuple[str, str], ...]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for n in names:
        try:
            out.append((n, version(n)))
        except PackageNotFoundError:
            continue
    return tuple(out)


def io_specs(model_proto) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Read names, dtypes and (symbolic) shapes of a graph's inputs and outputs."""
    import onnx
    from onnx import helper

    def spec(vi) -> TensorSpec:
        tt = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        dims = tuple(d.dim_param if d.dim_param else int(d.dim_value) for d in tt.shape.dim)
        return TensorSpec(vi.name, dtype, dims)

    assert isinstance(model_proto, onnx.ModelProto)
    return tuple(spec(i) for i in model_proto.graph.input), tuple(spec(o) for o in model_proto.graph.output)


def export_graph(module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
                 dynamic_shapes: dict) -> None:
    """Dynamo export to ``path`` with weights as external data next to it (standard ai.onnx ops)."""
    import torch

    # The exporter logs, at WARNING, every optional op library it finds missing (torchvision's nms,
    # roi_align, ...): nothing this graph uses. Errors still show.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            module,
            args,
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=dynamic_shapes,
            opset_version=OPSET,
            external_data=True,
            optimize=True,
            verbose=False,
        )
        prog.save(str(path), external_data=True)


def graph_entry(bundle_dir: Path, role: str, file: str, target: str = "trt", precision: str = "fp32") -> GraphEntry:
    import onnx

    path = bundle_dir / file
    proto = onnx.load(str(path), load_external_data=False)
    data = sorted({
        t.external_data[i].value
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for i in range(len(t.external_data))
        if t.external_data[i].key == "location"
    })
    inputs, outputs = io_specs(proto)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), OPSET)
    sha = hash_files([path, *(bundle_dir / d for d in data)])
    props = {p.key: p.value for p in proto.metadata_props}
    rows = int(props.get(ATTENTION_ROWS_KEY, 1))
    taps = contract.parse_feature_layers(props.get(contract.FEATURE_LAYERS_KEY))
    held = tuple(tuple(pair) for pair in json.loads(props.get(WEIGHT_BLOCKS_KEY, "[]")))
    return GraphEntry(role, file, sha, tuple(data), inputs, outputs, int(opset), target, precision, rows, taps,
                      held, props.get(ROWS_APART_KEY) == "1")
