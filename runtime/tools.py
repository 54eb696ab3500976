"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` over the model's own chat template.

- **Rendering.** Where the bundle's chat template renders tools itself (Qwen2.5's, Llama 3.1's), it gets them as
  transformers' ``apply_chat_template(tools=...)`` passes them, so the prompt is the one the model was trained on.
  Where it has none (SmolLM2's), :func:`generic_messages` puts the tools' signatures in the system message in the
  Hermes form (``<tools>`` ... ``</tools>``, calls inside ``<tool_call>`` tags), renders an assistant's earlier
  calls as that text and tool results as ``<tool_response>`` blocks in a user turn, as Qwen's template does.
- **Formats.** ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call
  (Qwen2.5, Hermes, and the generic rendering). ``llama3-json``: the answer is ``{"name": ..., "parameters": {...}}``
  (Llama 3.x's JSON tool calling), after an optional ``<|python_tag|>``.
- **Constraint.** ``tool_choice="required"`` or a named function compiles a grammar that only lets the answer be
  calls in the format, each an object whose ``name`` is one of the allowed functions and whose arguments match that
  function's ``parameters`` schema. The grammar then masks every verified row (``runtime/grammar.py``), so every
  draft source stays exact, and the keys, quotes and the function name are forced tokens: free drafts.
- **Parsing.** :class:`ToolCallParser` holds back streamed text from the first possible call on, and splits the
  final text into content and ``tool_calls`` (OpenAI's form: an id, ``type``, and ``function.name`` and
  ``function.arguments`` as a JSON string). Text that does not parse as a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import PromptError

FORMATS = ("hermes", "llama3-json")
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# The JSON the calls are written in: json.dumps' separators, as the templates' ``tojson`` renders earlier calls.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

GENERIC_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
GENERIC_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call>")


class ToolError(PromptError):
    """A request's tools or tool_choice that cannot be served; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools (OpenAI's function tools, checked) and what it asks of them.

    ``choice``: ``none`` (the tools are not shown to the model and no call is parsed), ``auto`` (the model may
    call), ``required`` (the answer is one or more calls) or ``function`` (one call of ``name``)."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Sequence[dict] | None, tool_choice: Any = None,
              parallel_tool_calls: bool | None = None) -> ToolSpec | None:
        """The spec of OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when there are no
        tools and no choice needs them; :class:`ToolError` in one sentence where they are wrong."""
        checked = tuple(_check_tool(t, i) for i, t in enumerate(tools or ()))
        names = [t["function"]["name"] for t in checked]
        if len(set(names)) != len(names):
            raise ToolError("Two tools have the same function name.")
        choice, name = _choice(tool_choice)
        if name is not None and name not in names:
            raise ToolError(f"tool_choice names the function '{name}', which is not among the request's tools.",
                            param="tool_choice")
        if choice in ("required", "function") and not checked:
            raise ToolError(f"tool_choice '{tool_choice if choice == 'required' else name}' needs tools.",
                            param="tool_choice")
        if not checked:
            return None
        return cls(checked, "auto" if choice is None else choice, name,
                   True if parallel_tool_calls is None else bool(parallel_tool_calls))

    @property
    def shown(self) -> bool:
        """Whether the model sees the tools (and its answer is parsed for calls)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls (constrained by the call grammar)."""
        return self.choice in ("required", "function")

    def allowed(self) -> tuple[dict, ...]:
        """The function tools a call may name."""
        return tuple(t for t in self.tools if self.name is None or t["function"]["name"] == self.name)


def _check_tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f"{where} must be an object with type 'function' and a function.")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function has no name.")
    if not _NAME.match(name):
        raise ToolError(f"{where}.function.name '{name[:80]}' must be 1 to 64 letters, digits, '_' or '-'.")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object.")
    if params.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must describe an object (type 'object').")
    described = {"description": fn["description"]} if isinstance(fn.get("description"), str) else {}
    return {"type": "function", "function": {"name": name, **described, "parameters": params}}


def _choice(tool_choice: Any) -> tuple[str | None, str | None]:
    if tool_choice is None:
        return None, None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice '{tool_choice[:40]}' is not one of none, auto, required or a named "
                            "function.", param="tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}.", param="tool_choice")
    return "function", fn["name"]


# --- rendering -----------------------------------------------------------------------------------
def template_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI chat messages as chat templates take them: an assistant's ``tool_calls`` with their arguments as
    objects, a tool message's ``tool_call_id`` kept, missing content as ""."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise PromptError("Each message must be an object with a role and content.")
        msg = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in m["tool_calls"]]
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw if raw is not None else {}


def generic_messages(messages: Sequence[dict], spec: ToolSpec | None) -> list[dict]:
    """``messages`` (as :func:`template_messages` gives them) for a template without tools: the tools' signatures
    appended to the system message (one is added where there is none), earlier calls written out in the Hermes
    form, and each run of tool results one user turn of ``<tool_response>`` blocks."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # a run of results is one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": role, "content": content})
    if spec is not None and spec.shown:
        block = GENERIC_HEADER + "".join("\n" + to_json(t) for t in spec.tools) + GENERIC_FOOTER
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


TAGS = (_OPEN, _CLOSE)


def hermes_call(name: str, arguments: Any) -> str:
    return f"{_OPEN}\n{{\"name\": {to_json(name)}, \"arguments\": {to_json(arguments)}}}\n{_CLOSE}"


def to_json(value: Any) -> str:
    """JSON as transformers' chat-template ``tojson`` writes it (keys in order, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


# --- the call grammar ----------------------------------------------------------------------------
def call_grammar(spec: ToolSpec, fmt: str, token_ids: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's, with ``%json``) whose sentences are calls of ``spec``'s allowed functions in
    ``fmt``, each function's arguments matching its parameters schema. ``token_ids``: the tags that the vocabulary
    holds as tokens of their own (Qwen's ``<tool_call>``), which the grammar then names by id: the model writes
    them as those tokens, and llguidance takes an added token only where the grammar names it."""
    key = "parameters" if fmt == "llama3-json" else "arguments"
    objects = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  key: t["function"]["parameters"]},
                "required": ["name", key], "additionalProperties": False} for t in spec.allowed()]
    schema = (objects[0] if len(objects) == 1 else {"anyOf": objects}) | {"x-guidance": _JSON_STYLE}
    body = "call_json: %json " + json.dumps(schema)
    if fmt == "llama3-json":
        return f"start: call_json\n{body}\n"
    ids = token_ids or {}
    tag = {t: f"<[{ids[t]}]>" if t in ids else json.dumps(t) for t in (_OPEN, _CLOSE)}
    many = '("\\n" call)*' if spec.parallel and spec.name is None else ""
    return f'start: call {many}\ncall: {tag[_OPEN]} "\\n" call_json "\\n" {tag[_CLOSE]}\n{body}\n'


# --- parsing -------------------------------------------------------------------------------------
class ToolCallParser:
    """Splits an answer into content and calls in one format (:data:`FORMATS`)."""

    def __init__(self, fmt: str, forced: bool = False):
        if fmt not in FORMATS:
            raise ToolError(f"The tool call format '{fmt}' is not one of {', '.join(FORMATS)}.")
        self.fmt, self.forced = fmt, forced

    def content_end(self, text: str) -> int:
        """How much of a growing ``text`` is surely content: streamed text stops before a call may start (and
        before the whitespace that would end the content if one does)."""
        return len(text[: self._content_end(text)].rstrip())

    def _content_end(self, text: str) -> int:
        if self.forced:
            return 0
        if self.fmt == "llama3-json":
            head = text.lstrip()
            maybe = head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head)
            return 0 if maybe else len(text)
        at = text.find(_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(_OPEN) - 1, len(text)), 0, -1):  # a tag's start at the end: wait for the rest
            if _OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def parse(self, text: str) -> tuple[str, tuple[dict, ...]]:
        """``(content, tool_calls)``; the whole text as content where no call parses."""
        calls: list[dict] = []
        if self.fmt == "llama3-json":
            head = text.strip()
            head = head[len(_PYTHON_TAG):].strip() if head.startswith(_PYTHON_TAG) else head
            obj = _json(head)
            call = _call(obj, ("parameters", "arguments"))
            return ("", (call,)) if call else (text, ())
        at = text.find(_OPEN)
        if at < 0:
            return text, ()
        blocks = list(re.finditer(re.escape(_OPEN) + r"(.*?)(" + re.escape(_CLOSE) + r"|$)", text[at:], re.DOTALL))
        for k, block in enumerate(blocks):
            call = _call(_json(block.group(1).strip()), ("arguments", "parameters"))
            if call is None:
                if k and k == len(blocks) - 1 and not block.group(2):  # the last call was cut off (length)
                    break
                return text, ()
            calls.append(call)
        return text[:at].rstrip(), tuple(calls)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj: Any, keys: tuple[str, str]) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = _json(args) if _json(args) is not None else args
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else to_json(args)}}
