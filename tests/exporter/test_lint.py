"""The ONNX lint: the exported graphs pass, hand-made graphs fail with the right rule and node name."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper
from specdeploy.exporter.check.lint import (
    MAX_OPSET,
    MIN_OPSET,
    RULE_CONTROL_FLOW,
    RULE_DATA_SHAPE,
    RULE_DOMAIN,
    RULE_OPSET,
    RULE_SEQUENCE,
    lint_bundle,
    lint_graph,
    lint_model,
)
from specdeploy.exporter.cli import main

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, opset: int = 18, extra_opsets=(), initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    return helper.make_model(graph, opset_imports=imports)


def _vi(name, elem=F, shape=("n",)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _save(tmp_path: Path, model, name: str = "g.onnx") -> Path:
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _rules(issues) -> set[tuple[str, str]]:
    return {(i.rule, i.node) for i in issues}


def test_tiny_bundle_passes(tiny_bundle):
    results = lint_bundle(tiny_bundle)
    assert [(g.role, g.file) for g in results] == [("base", "base.onnx"), ("base", "base-ort.onnx"),
                                                       ("base", "base-tree.onnx")]
    assert results[0].passed, [str(i) for i in results[0].issues]
    assert results[1].skipped and "ort" in results[1].skipped  # ONNX Runtime's fused graph: not for TensorRT
    out = CliRunner().invoke(main, ["lint", str(tiny_bundle)])
    assert out.exit_code == 0, out.output
    assert out.output.strip().splitlines()[-1] == "PASSED"


def test_if_node_breaks_control_flow(tmp_path):
    then_g = helper.make_graph([helper.make_node("Identity", ["x"], ["t"], name="then_id")], "then", [], [_vi("t")])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="else_neg")], "else", [], [_vi("e")])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Cast", ["s"], ["c"], name="to_bool", to=TensorProto.BOOL),
        helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=then_g, else_branch=else_g),
    ]
    issues = lint_graph(_save(tmp_path, _model(nodes, [_vi("x")], [_vi("y")])))
    assert _rules(issues) == {(RULE_CONTROL_FLOW, "branchy")}
    assert issues[0].op_type == "If" and "g.onnx: node 'branchy' (If)" in str(issues[0])


def test_loop_and_scan_break_control_flow():
    body = helper.make_graph([helper.make_node("Identity", ["c_in"], ["c_out"], name="b")], "body",
                             [_vi("i", I64, ()), _vi("c_in", TensorProto.BOOL, ())],
                             [_vi("c_out", TensorProto.BOOL, ())])
    nodes = [helper.make_node("Loop", ["n", "cond"], [], name="looper", body=body)]
    model = _model(nodes, [_vi("n", I64, ()), _vi("cond", TensorProto.BOOL, ())], [])
    assert _rules(lint_model(model)) == {(RULE_CONTROL_FLOW, "looper")}


def test_contrib_op_breaks_standard_domain(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="ok_relu"),
        helper.make_node("FastGelu", ["r"], ["y"], name="gelu_ms", domain="com.microsoft"),
    ]
    model = _model(nodes, [_vi("x")], [_vi("y")], extra_opsets=[("com.microsoft", 1)])
    issues = lint_graph(_save(tmp_path, model))
    assert _rules(issues) == {(RULE_DOMAIN, "gelu_ms")}
    assert "com.microsoft" in issues[0].detail


def test_nonzero_breaks_data_dependent_shape(tmp_path):
    nodes = [helper.make_node("NonZero", ["x"], ["y"], name="where_nz")]
    issues = lint_graph(_save(tmp_path, _model(nodes, [_vi("x")], [_vi("y", I64, (1, "k"))])))
    assert _rules(issues) == {(RULE_DATA_SHAPE, "where_nz")}
    # Outside step graphs the rule does not apply.
    assert lint_graph(tmp_path / "g.onnx", step_graph=False) == []


def test_topk_with_k_computed_from_data_fails_but_constant_k_passes():
    k_const = helper.make_tensor("k", I64, [1], [4])
    ok = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk_const")],
                [_vi("x")], [_vi("v"), _vi("i", I64)], initializers=[k_const])
    assert lint_model(ok) == []
    nodes = [
        helper.make_node("ReduceMax", ["ids"], ["m"], name="max_id", keepdims=1),
        helper.make_node("TopK", ["x", "m"], ["v", "i"], name="topk_data"),
    ]
    bad = _model(nodes, [_vi("x"), _vi("ids", I64, (1,))], [_vi("v"), _vi("i", I64)])
    assert _rules(lint_model(bad)) == {(RULE_DATA_SHAPE, "topk_data")}


def test_range_from_values_fails_reshape_from_shape_passes():
    # Reshape(x, Concat(Shape(x)[0:1], [-1])) depends on shapes only.
    minus1 = helper.make_tensor("minus1", I64, [1], [-1])
    ok_nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape", start=0, end=1),
        helper.make_node("Concat", ["s", "minus1"], ["shp"], name="cat", axis=0),
        helper.make_node("Reshape", ["x", "shp"], ["y"], name="reshape_ok"),
    ]
    ok = _model(ok_nodes, [_vi("x", F, ("a", "b"))], [_vi("y", F, ("a", "c"))], initializers=[minus1])
    assert lint_model(ok) == []
    zero = helper.make_tensor("zero", I64, [], [0])
    one = helper.make_tensor("one", I64, [], [1])
    idx = helper.make_tensor("idx", I64, [], [0])
    bad_nodes = [
        helper.make_node("Gather", ["position_ids", "idx"], ["p0"], name="first_pos"),
        helper.make_node("Range", ["zero", "p0", "one"], ["r"], name="range_from_pos"),
    ]
    bad = _model(bad_nodes, [_vi("position_ids", I64)], [_vi("r", I64, ("k",))], initializers=[zero, one, idx])
    assert _rules(lint_model(bad)) == {(RULE_DATA_SHAPE, "range_from_pos")}


@pytest.mark.parametrize("opset", [MIN_OPSET - 2, MAX_OPSET + 1])
def test_opset_out_of_range(tmp_path, opset):
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_vi("x")], [_vi("y")], opset=opset)
    issues = lint_graph(_save(tmp_path, model))
    assert _rules(issues) == {(RULE_OPSET, "<model>")}
    assert str(opset) in issues[0].detail


def test_sequence_ops_and_unnamed_nodes_are_reported():
    nodes = [helper.make_node("SequenceConstruct", ["x"], ["s"]), helper.make_node("SequenceAt", ["s", "i"], ["y"])]
    model = _model(nodes, [_vi("x"), _vi("i", I64, ())], [_vi("y")])
    assert _rules(lint_model(model)) == {(RULE_SEQUENCE, "<unnamed #0>"), (RULE_SEQUENCE, "<unnamed #1>")}


def test_cli_lint_fails_and_names_the_node(tiny_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    bad = _model([helper.make_node("NonZero", ["x"], ["y"], name="nz_node")], [_vi("x")], [_vi("y", I64, (1, "k"))])
    onnx.save(bad, str(bundle / "base.onnx"))
    out = CliRunner().invoke(main, ["lint", str(bundle)])
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert lines[-1] == "FAILED"
    assert any("nz_node" in ln and RULE_DATA_SHAPE in ln for ln in lines)


def test_unreadable_graph_is_one_sentence(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x00not a protobuf at all")
    from specdeploy.runtime.errors import BundleError

    with pytest.raises(BundleError, match="not a readable ONNX model"):
        lint_graph(path)
