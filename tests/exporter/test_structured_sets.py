"""The structured prompt sets (json-extraction, tool-calls, json-template): their items and constraints, the checks of
answers, and a constrained bench on the tiny bundle (the real model's run is tests/integration/test_structured_bench.py)."""

from __future__ import annotations

import json
from importlib import metadata

import llguidance
import pytest
from click.testing import CliRunner
from specdeploy.exporter.bench import promptsets as ps
from specdeploy.exporter.bench.structured import (
    Constraint,
    call_signature,
    check_answer,
    schema_errors,
    tool_call_schema,
    tool_calls_in_text,
)
from specdeploy.exporter.bench.structured_sets import SCHEMAS, TOOLS, extraction_records
from specdeploy.exporter.cli import main


def _has_evals() -> bool:
    try:
        metadata.distribution(ps.EVALS)
    except metadata.PackageNotFoundError:
        return False
    return True


def _compiles(schema: dict) -> None:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert not llguidance.LLMatcher.validate_grammar(grammar), (schema, llguidance.LLMatcher.validate_grammar(grammar))


def _json_sets() -> list[str]:
    return ["json-template", *(["json-extraction"] if _has_evals() else [])]


@pytest.mark.parametrize("name", ["json-extraction", "json-template"])
def test_json_sets_carry_a_schema_that_compiles(name):
    if name == "json-extraction" and not _has_evals():
        pytest.skip(f"needs the evals package's data: pip install --no-deps {ps.EVALS}")
    items = ps.load_set(name, 25)
    assert len(items) == 25 and items == ps.load_set(name, 25)  # deterministic
    assert all(it.category == name and it.constraint is not None and it.tools is None for it in items)
    schemas = {json.dumps(it.constraint.schema, sort_keys=True) for it in items}
    assert len(schemas) == (len(SCHEMAS) if name == "json-extraction" else 1)
    for it in items:
        rf = it.response_format
        assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True and rf["json_schema"]["name"]
    for s in schemas:
        _compiles(json.loads(s))
    assert len({it.text for it in items}) == len(items)  # every record its own


def test_extraction_records_read_each_file_layout():
    """The five evals files as they are laid out (only what the parser reads), without the 755 MB package."""
    def rec(user: str, system: str = "task", ideal: str = "x") -> dict:
        return {"input": [{"role": "system", "content": system}, {"role": "user", "content": user}], "ideal": ideal}

    rows = {"product": [rec("Sony VAIO 13.3\" Laptop \n Requested Attribute: Brand"),
                        rec("Sony VAIO 13.3\" Laptop \n Requested Attribute: RAM")],
            "payment": [{"input": [{"role": "system", "content": "Read it.\n-\nEMAIL \n\nSUBJECT: Paid $5"}]},
                        {"input": [{"role": "system", "content": "Read it.\n-\nEMAIL " + "word " * 200}]}],
            "entities": [rec("This AGREEMENT between SILICON VALLEY BANK and AKAMAI TECHNOLOGIES , INC . is made here ."),
                         rec("The parties agree as follows :"),
                         rec("Calculations must be made following the rules set out in this agreement here .",
                             ideal="No entities found")],
            "event": [rec("The boot type was 0x0.")],
            "study": [rec("Title.\n\nA randomized trial of 80 patients."), rec("long " * 300)]}
    got = extraction_records(rows)
    assert got == {"product": ["Sony VAIO 13.3\" Laptop"], "payment": ["SUBJECT: Paid $5"],
                   "entities": ["This AGREEMENT between SILICON VALLEY BANK and AKAMAI TECHNOLOGIES , INC . is made here ."],
                   "event": ["The boot type was 0x0."], "study": ["Title. A randomized trial of 80 patients."]}


def test_tool_set_offers_two_to_four_valid_tools_one_of_which_fits():
    items = ps.load_set("tool-calls", 24)
    assert len(items) == 24 and items == ps.load_set("tool-calls", 24)
    fitting = set()
    for i, it in enumerate(items):
        assert it.category == "tool-calls" and it.tool_choice == "required" and it.response_format is None
        assert 2 <= len(it.tools) <= 4
        names = [t["function"]["name"] for t in it.tools]
        assert len(set(names)) == len(names)
        fits = list(TOOLS)[i % len(TOOLS)]
        assert fits in names
        fitting.add(fits)
        for t in it.tools:
            fn = t["function"]
            assert t["type"] == "function" and fn["name"] and fn["description"]
            assert fn["parameters"]["type"] == "object" and set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])
        _compiles(tool_call_schema(it.tools))
    assert fitting == set(TOOLS)  # every tool is the fitting one somewhere
    for t in TOOLS.values():
        _compiles(t["function"]["parameters"])


def test_structured_aggregate_and_set_names():
    assert {"json-extraction", "tool-calls", "json-template", "structured", "spec-bench"} <= set(ps.SETS)
    if not _has_evals():
        pytest.skip(f"needs the evals package's data: pip install --no-deps {ps.EVALS}")
    items = ps.load_set("structured", 2)
    assert [it.category for it in items] == [c for c in ps.STRUCTURED for _ in range(2)]


def test_answers_are_checked_against_schema_and_tools():
    person = ps.load_set("json-template", 1)[0].constraint
    assert check_answer(person, '{"name": "Ann", "age": 30, "occupation": "nurse", "city": "Oslo"}') is None
    assert "age" in check_answer(person, '{"name": "Ann", "age": "30", "occupation": "nurse", "city": "Oslo"}')
    assert "not JSON" in check_answer(person, '{"name": "Ann", "ag')
    schema = SCHEMAS["payment"]
    assert schema_errors(schema, {"sender": "a", "kind": "charge", "amounts": [{"value": 1.5, "currency": "USD"}]}) == []
    assert schema_errors(schema, {"sender": "a", "kind": "gift", "amounts": []})  # not in the enum
    assert schema_errors(schema, {"sender": "a", "kind": "charge", "amounts": [{"value": 1}]})  # nested required

    tools = (TOOLS["get_weather"], TOOLS["start_timer"])
    need = Constraint(tools=tools, tool_choice="required")
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    assert check_answer(need, hermes) is None
    assert check_answer(need, '{"name": "start_timer", "arguments": {"minutes": 5}}') is None  # llama.cpp's JSON
    assert "unknown tool" in check_answer(need, '{"name": "send_email", "arguments": {}}')
    assert "start_timer" in check_answer(need, '{"name": "start_timer", "arguments": {"minutes": "5"}}')
    assert check_answer(need, "It is sunny.") == "no complete tool call"
    assert check_answer(need, '<tool_call>\n{"name": "get_weather", "arguments": {"ci') == "no complete tool call"
    parsed = [{"id": "call_x", "type": "function", "function": {"name": "start_timer", "arguments": '{"minutes": 5}'}}]
    assert check_answer(need, "", parsed) is None
    assert call_signature(parsed) == call_signature(tool_calls_in_text('{"name": "start_timer", "arguments": {"minutes": 5}}'))


def test_a_constrained_bench_on_the_tiny_bundle_reports_validity_and_the_unconstrained_baseline(tmp_path, tiny_bundle):
    """json-template on the tiny (random) model: ar and prompt-lookup decode under the schema, identically;
    ar-unconstrained joins on its own; hf (no constraint) is skipped with a note; every answer's validity is
    reported (a random model's answer may be cut by the budget: then it is counted so)."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_bundle), "--variants", "ar,prompt-lookup,hf", "--prompt-set",
                                       "json-template", "--num-prompts", "2", "--max-new-tokens", "12",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    by = {v["name"]: v for v in report["variants"]}
    assert list(by) == ["ar", "prompt-lookup", "hf", "ar-unconstrained"]
    assert by["hf"]["skipped"] and "no JSON schema or tool constraint" in by["hf"]["note"]
    assert by["prompt-lookup"]["identical_to_ar"] is True
    assert report["config"]["constrained_prompts"] == 2
    for name in ("ar", "prompt-lookup", "ar-unconstrained"):
        v = by[name]
        assert v["constrained_prompts"] == 2
        for p in v["prompts"]:
            assert p["valid"] is True or p["finish_reason"] == "length", p
        cat = v["categories"]["json-template"]
        assert cat["valid_prompts"] == v["valid_prompts"] and cat["cut_prompts"] is not None
    assert "decoded without the prompts' constraint" in (by["ar-unconstrained"]["note"] or "") or \
        by["ar-unconstrained"]["identical_to_ar"]
    table = out.with_suffix(".md").read_text()
    assert "Structured output by category" in table and "Constrained ar against ar without the constraint" in table
