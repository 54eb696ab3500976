"""Structured output in the benches: what a constrained prompt asks for, and whether an answer gives it.

A :class:`Constraint` is what an OpenAI request carries beside its messages: a ``response_format`` (a JSON schema)
or ``tools`` with a ``tool_choice``. :func:`check_answer` says whether an answer meets it: its text is JSON valid
against the schema, or its tool calls name a known tool with arguments valid against that tool's ``parameters``.
Schemas are checked with the ``jsonschema`` package where it is installed, else with :func:`schema_errors`, a
small checker of the keywords the bench's schemas use (type, enum, const, properties, required,
additionalProperties, items, min/maxItems, minimum/maximum, min/maxLength, pattern, anyOf).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}
_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Constraint:
    """A prompt's constraint: ``response_format`` (OpenAI's ``json_schema`` form) or ``tools`` (OpenAI function
    tools) with ``tool_choice`` ("required", "auto", "none" or ``{"type": "function", "function": {"name": ...}}``)."""

    response_format: dict | None = None
    tools: tuple[dict, ...] | None = None
    tool_choice: str | dict | None = None

    @property
    def schema(self) -> dict | None:
        """The JSON schema a ``json_schema`` response format asks for (None for tools or ``json_object``)."""
        rf = self.response_format or {}
        return (rf.get("json_schema") or {}).get("schema") if rf.get("type") == "json_schema" else None

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments of ``Engine.stream`` (and the fields of a chat request) that carry it."""
        out: dict[str, Any] = {}
        if self.response_format is not None:
            out["response_format"] = self.response_format
        if self.tools is not None:
            out["tools"] = [dict(t) for t in self.tools]
            out["tool_choice"] = self.tool_choice if self.tool_choice is not None else "auto"
        return out

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any]) -> Constraint:
        tools = keywords.get("tools")
        return cls(keywords.get("response_format"), tuple(tools) if tools is not None else None,
                   keywords.get("tool_choice"))


def json_schema_format(name: str, schema: dict) -> dict:
    """OpenAI's strict ``json_schema`` response format for ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def function_tool(name: str, description: str, properties: dict, required: tuple[str, ...]) -> dict:
    """One OpenAI function tool whose arguments are an object of ``properties``."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required), "additionalProperties": False}}}


# --- checking answers --------------------------------------------------------------------------------
def schema_errors(schema: dict, value: Any, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (empty: valid), for the keywords this module's docstring lists."""
    errors: list[str] = []
    if "anyOf" in schema and all(schema_errors(s, value, where) for s in schema["anyOf"]):
        errors.append(f"{where}: matches none of anyOf")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in enum")
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is_type(value, k) for k in kinds):
            return errors + [f"{where}: not of type {'/'.join(kinds)}"]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{where}: missing '{k}'" for k in schema.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(props[k], v, f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected key '{k}'")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: {len(value)} items")
        if isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                errors += schema_errors(schema["items"], v, f"{where}[{i}]")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{where}: length {len(value)}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: does not match {schema['pattern']!r}")
    if _is_type(value, "number") and (value < schema.get("minimum", value) or value > schema.get("maximum", value)):
        errors.append(f"{where}: {value} out of range")
    return errors


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(kind, object))


def validation_error(schema: dict, value: Any) -> str | None:
    """Why ``value`` is not valid against ``schema``, or None (``jsonschema`` where installed)."""
    try:
        import jsonschema
    except ImportError:
        errors = schema_errors(schema, value)
        return errors[0] if errors else None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:  # where in the value, as the small checker says it
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path).lstrip(".")
        return f"{where or '(the value)'}: {exc.message}"
    return None


def tool_calls_in_text(text: str) -> list[dict]:
    """The tool calls an answer's text writes, in OpenAI's form: Hermes ``<tool_call>`` blocks, or else JSON
    objects with a ``name`` and ``arguments`` (or Llama 3's ``parameters``). Unparsable blocks are left out."""
    chunks = _TOOL_BLOCK.findall(text) if "<tool_call>" in text else [text]
    calls = []
    decoder = json.JSONDecoder()
    for chunk in chunks:
        at = chunk.find("{")
        while at >= 0:
            try:
                obj, end = decoder.raw_decode(chunk, at)
            except json.JSONDecodeError:
                break
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters"))
                calls.append({"id": f"call_{len(calls)}", "type": "function", "function": {
                    "name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
            at = chunk.find("{", end)
    return calls


def check_answer(constraint: Constraint, text: str, tool_calls: list[dict] | None = None) -> str | None:
    """Why an answer does not meet ``constraint``, or None. ``tool_calls``: the calls the runtime parsed (else
    they are read from ``text``)."""
    if constraint.tools is not None:
        calls = tool_calls if tool_calls else tool_calls_in_text(text)
        if not calls:
            return "no complete tool call" if constraint.tool_choice not in (None, "auto", "none") else None
        params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in constraint.tools}
        for call in calls:
            fn = call.get("function") or {}
            if fn.get("name") not in params:
                return f"unknown tool {fn.get('name')!r}"
            try:
                args = json.loads(fn.get("arguments") or "null")
            except json.JSONDecodeError:
                return f"{fn['name']}: arguments are not JSON"
            if (why := validation_error(params[fn["name"]], args)) is not None:
                return f"{fn['name']}: {why}"
        return None
    if constraint.response_format is not None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON ({exc.msg}, character {exc.pos})"
        schema = constraint.schema
        return None if schema is None else validation_error(schema, value)
    return None


def call_signature(calls: list[dict]) -> list[tuple[str, Any]]:
    """Tool calls as (name, parsed arguments): what two answers must share to be the same calls (ids differ)."""
    out = []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "null")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        out.append((fn.get("name"), args))
    return out


def tool_call_schema(tools: tuple[dict, ...]) -> dict:
    """One call as JSON, ``{"name": ..., "arguments": {...}}`` of one of ``tools``: the schema a runner without
    tool calling of its own (llama.cpp's grammar) decodes a required call with."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "arguments": t["function"].get("parameters") or {}},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
