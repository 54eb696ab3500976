"""The OpenAI SDK against `specdeploy serve` on the main job's bundle (Q4_1 blocks, the default draft), on every
prompt of the structured sets: ``parse()`` with a pydantic model built from each extraction schema returns a parsed
object, and ``tool_choice="required"`` returns a call of an offered tool whose arguments meet its schema.

A sweep (about three minutes on 2 cores): ``SPECDEPLOY_SWEEPS=1`` or ``-m sweep``."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pytest
from serving import Server

COUNT = 20  # the acceptance's 20-prompt sets


def _model(name: str, schema: dict) -> Any:
    """A pydantic model for the structured sets' JSON schemas (objects, bounded strings and integers, numbers,
    booleans, enums and bounded arrays), as a user would write it for ``parse()``."""
    from pydantic import ConfigDict, Field, create_model

    def kind(where: str, sub: dict) -> Any:
        if "enum" in sub:
            return Literal[tuple(sub["enum"])]
        t = sub["type"]
        if t == "object":
            return _model(where, sub)
        if t == "array":
            return Annotated[list[kind(where + "_item", sub["items"])], Field(max_length=sub.get("maxItems"))]
        if t == "string":
            return Annotated[str, Field(max_length=sub.get("maxLength"), pattern=sub.get("pattern"))]
        if t == "integer":
            return Annotated[int, Field(ge=sub.get("minimum"), le=sub.get("maximum"))]
        return {"number": float, "boolean": bool}[t]

    required = set(schema.get("required", ()))
    fields = {key: (kind(f"{name}_{key}", sub), ...) if key in required
              else (kind(f"{name}_{key}", sub) | None, None) for key, sub in schema["properties"].items()}
    return create_model(name.title().replace("_", ""), __config__=ConfigDict(extra="forbid"), **fields)


@pytest.mark.slow
@pytest.mark.sweep
def test_sdk_parse_and_required_tool_calls_on_every_prompt(real_quant_bundle, tmp_path):
    from openai import OpenAI
    from specdeploy.exporter.bench.promptsets import json_extraction, tool_calls
    from specdeploy.exporter.bench.structured import validation_error
    from specdeploy.exporter.bench.structured_sets import SCHEMAS

    models = {name: _model(name, schema) for name, schema in SCHEMAS.items()}
    by_schema = {json.dumps(s, sort_keys=True): n for n, s in SCHEMAS.items()}
    srv = Server(real_quant_bundle("q4_1"), tmp_path / "server.log")
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
            model = client.models.list().data[0].id
            for item in json_extraction(COUNT):
                name = by_schema[json.dumps(item.response_format["json_schema"]["schema"], sort_keys=True)]
                out = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": item.text}],
                                                    response_format=models[name], max_tokens=256, temperature=0)
                parsed = out.choices[0].message.parsed
                assert isinstance(parsed, models[name]), (item.text, out.choices[0].message.content)
            for item in tool_calls(COUNT):
                out = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": item.text}], tools=list(item.tools),
                    tool_choice="required", max_tokens=256, temperature=0)
                calls = out.choices[0].message.tool_calls  # parallel calls allowed: a later one may be cut
                assert calls and out.choices[0].finish_reason in ("tool_calls", "length"), (item.text, out.choices[0])
                offered = {t["function"]["name"]: t["function"]["parameters"] for t in item.tools}
                for call in calls:
                    args = json.loads(call.function.arguments)
                    assert validation_error(offered[call.function.name], args) is None, (item.text, call)
    finally:
        srv.stop()
