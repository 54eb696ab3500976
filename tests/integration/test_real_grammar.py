"""The main job's bundle (SmolLM2 as its Q4_1 blocks): JSON extraction under a schema, every draft source equal to
constrained plain decoding token for token, the answers parse, and the grammar's forced tokens are drafted."""

from __future__ import annotations

import json

import pytest
from specdeploy.runtime import load

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "age"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
RECORDS = ["Maria Lopez, 34, moved to Valencia last spring.",
           "Our new colleague is Tom Becker (age 51) from Hamburg.",
           "Aiko Tanaka lives in Osaka; she turned 28 in May.",
           "Born 45 years ago, Samuel Okafor has always lived in Lagos."]


@pytest.mark.slow
def test_json_extraction_is_exact_for_every_draft_source(real_quant_bundle):
    out = real_quant_bundle("q4_1")
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    msgs = [[{"role": "user", "content": f"Extract the person as JSON with name, city and age: {r}"}] for r in RECORDS]
    kw = {"max_new_tokens": 48, "response_format": rf}
    with load(out, draft=None) as plain:
        want = [plain.generate(messages=m, **kw) for m in msgs]
    for w, record in zip(want, RECORDS):
        person = json.loads(w.text)
        assert set(person) == {"name", "city", "age"} and person["name"].split()[0] in record, w.text
    for draft in ("auto", "prompt-lookup"):
        with load(out, draft=draft) as spec:
            got = [spec.generate(messages=m, **kw) for m in msgs]
        assert [g.token_ids for g in got] == [w.token_ids for w in want], draft
        steps = sum(g.stats.steps + 1 for g in got)
        assert sum(g.stats.new_tokens for g in got) > 1.5 * steps, draft  # keys, quotes, copied values: drafted


TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city.",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 40},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {
             "name": "convert_currency", "description": "Convert an amount of money into another currency.",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["amount", "from", "to"],
                            "properties": {"amount": {"type": "number"}, "from": {"type": "string", "maxLength": 3},
                                           "to": {"type": "string", "maxLength": 3}}}}}]
ASKS = ["What's the weather like in Paris today?", "How much is 250 US dollars in euros?",
        "Do I need an umbrella in London right now?"]


@pytest.mark.slow
def test_required_tool_calls_parse_and_are_exact_for_every_draft_source(real_quant_bundle):
    """SmolLM2's template has no tools: the generic rendering; the call is constrained, so it always parses, and
    the keys, the tags and the function's name are forced tokens: drafted for free."""
    out = real_quant_bundle("q4_1")
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_new_tokens": 64}
    msgs = [[{"role": "user", "content": a}] for a in ASKS]
    with load(out, draft=None) as plain:
        want = [plain.generate(messages=m, **kw) for m in msgs]
    for w in want:
        assert w.finish_reason == "tool_calls" and len(w.tool_calls) == 1, w
        args = json.loads(w.tool_calls[0]["function"]["arguments"])
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == w.tool_calls[0]["function"]["name"])
        assert set(tool["parameters"]["required"]) <= set(args) <= set(tool["parameters"]["properties"]), w.text
    for draft in ("auto", "prompt-lookup"):
        with load(out, draft=draft) as spec:
            got = [spec.generate(messages=m, **kw) for m in msgs]
        assert [g.token_ids for g in got] == [w.token_ids for w in want], draft
        assert sum(g.stats.new_tokens for g in got) > 1.5 * sum(g.stats.steps + 1 for g in got), draft
