"""The OpenAI-compatible server's shapes: strict pydantic request schemas, OpenAI-style errors, and the
response and stream-chunk bodies.

Imported only by :mod:`specdeploy.runtime.server` (the ``serve`` extra), never by the lean runtime.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from .logprobs import MAX_TOP

if TYPE_CHECKING:
    from .engine import Completion
    from .logprobs import TokenLogprob

_MAX_STOP_CHARS = 256
MAX_COMPLETION_LOGPROBS = 5  # the completions endpoint's most alternatives per token, as OpenAI's
MAX_N = 16  # the most choices one request may ask for (each is a generation of its own)


def logprobs_asked(req: GenerationRequest) -> int | None:
    """How many alternatives per token the request asks log-probabilities for (None: none)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs if isinstance(req, CompletionRequest) else None


# --- request schema ------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default: sampling
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1 << 31)  # an extension, as in vLLM
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    guided_regex: str | None = None  # an extension, as vLLM spells it: the output matches this regular expression
    guided_grammar: str | None = None  # ... or this Lark grammar

    def constraint(self) -> dict[str, Any]:
        """The constraint keywords of ``Engine.stream`` this request asks for."""
        out: dict[str, Any] = {}
        if self.response_format is not None:
            out["response_format"] = self.response_format.model_dump(by_alias=True, exclude_none=True)
        if self.guided_regex is not None:
            out["regex"] = self.guided_regex
        if self.guided_grammar is not None:
            out["grammar"] = self.guided_grammar
        return out

    def constraint_param(self) -> str:
        """The request field a constraint error points at."""
        return "guided_regex" if self.guided_regex is not None else \
            "guided_grammar" if self.guided_grammar is not None else "response_format"


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # an assistant message with tool_calls may have none
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers
    refusal: str | None = None

    def text(self) -> str | None:
        return self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_options(self) -> dict[str, Any]:
        """The tool keywords of ``Engine.stream`` this request asks for."""
        if not self.tools and self.tool_choice is None:
            return {}
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools or ()], "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls}

    def chat_messages(self) -> list[dict]:
        """The messages as the engine takes them: developer as system, text parts joined, tool calls kept."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.text()
            if content is None and not (m.role == "assistant" and m.tool_calls):
                raise ApiError(400, f"messages[{i}] needs content.", param=f"messages[{i}].content",
                               code="invalid_value")
            if m.role == "tool" and not m.tool_call_id:
                raise ApiError(400, f"messages[{i}] is a tool message without a tool_call_id.",
                               param=f"messages[{i}].tool_call_id", code="invalid_value")
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.status == 503:
            headers = {"Retry-After": "1"}
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _param(loc: tuple, extra: bool = False) -> str | None:
    """``("messages", 0, "content", "str")`` -> ``"messages[0].content"`` (pydantic's union branch tags dropped)."""
    fields = set().union(*(m.model_fields for m in (ChatMessage, TextPart, StreamOptions, ToolCall, FunctionCall,
                                                     ToolDef, FunctionDef, NamedToolChoice, ResponseFormat)))
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i == 0 or part in fields or (extra and i == len(loc) - 1):
            out += f".{part}" if out else str(part)
    return out or None


def parse_request(model: type[_Strict], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = _param(err["loc"], extra=err["type"] == "extra_forbidden")
        if err["type"] == "json_invalid":
            msg = f"The request body is not valid UTF-8 JSON ({err['msg']})."
        elif err["type"] == "model_type":
            msg = "The request body must be a JSON object."
        elif err["type"] == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        elif err["type"] == "missing":
            msg = f"Missing required parameter: '{param}'."
        else:
            msg = f"Invalid value for '{param}': {err['msg']}."
        raise ApiError(400, msg, param=param, code="invalid_value" if param else None) from None


def check_supported(req: GenerationRequest) -> None:
    """Reject OpenAI features this server does not implement instead of silently ignoring them."""
    checks = [
        ("n", not 1 <= req.n <= MAX_N, f"n must be between 1 and {MAX_N}."),
        ("presence_penalty", req.presence_penalty != 0.0, "presence_penalty is not supported."),
        ("frequency_penalty", req.frequency_penalty != 0.0, "frequency_penalty is not supported."),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported."),
    ]
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    checks.append(("stop", len(stops) > 4, "At most 4 stop sequences are allowed."))
    checks.append(("stop", any(len(s) > _MAX_STOP_CHARS for s in stops),
                   f"A stop sequence may be at most {_MAX_STOP_CHARS} characters."))
    if isinstance(req, CompletionRequest):
        checks += [
            ("prompt", isinstance(req.prompt, list) and len(req.prompt) != 1, "Give exactly one prompt per request."),
            ("echo", req.echo, "echo is not supported."),
            ("best_of", req.best_of not in (None, 1), "Only best_of=1 is supported."),
            ("logprobs", req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS,
             f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}."),
            ("suffix", req.suffix is not None, "suffix is not supported."),
        ]
    if isinstance(req, ChatRequest):
        checks += [
            ("top_logprobs", req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP,
             f"top_logprobs must be between 0 and {MAX_TOP}."),
            ("top_logprobs", req.top_logprobs is not None and not req.logprobs,
             "top_logprobs needs logprobs set to true."),
        ]
    for param, bad, msg in checks:
        if bad:
            raise ApiError(400, msg, param=param, code="unsupported_value")


# --- response shapes -----------------------------------------------------------------------------
class ResponseShape:
    """How one endpoint's responses and stream chunks look."""

    def __init__(self, chat: bool, model: str, include_usage: bool, fingerprint: str = "",
                 token_text: Callable[[int], str] | None = None):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.fingerprint = fingerprint  # the engine's (Engine.fingerprint): says whether answers are exact
        self.token_text = token_text  # a token's text, where the request asked for log-probabilities
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def logprobs(self, entries: Sequence[TokenLogprob], offset: int = 0) -> dict | None:
        """The ``logprobs`` of a choice (or of a chunk's tokens), in the endpoint's form; None where not asked.
        ``offset``: the text position of the first entry's token (completions' ``text_offset``)."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:
            def item(tok: int, lp: float) -> dict:
                t = text(tok)
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

            return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        tokens = [text(e.token) for e in entries]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    def chunk(self, delta: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: dict | None = None, index: int = 0) -> dict:
        if self.chat:
            d: dict = {} if delta is None else {"content": delta}
            if role:
                d = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._head("text_completion") | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def tool_calls_chunk(self, calls: Sequence[dict], index: int = 0) -> dict:
        """A chat stream's chunk carrying a choice's tool calls whole (sent once the answer has ended)."""
        body = self.chunk(None, index=index)
        body["choices"][0]["delta"] = {"tool_calls": [{"index": k} | c for k, c in enumerate(calls)]}
        return body

    def usage_chunk(self, cs: Sequence[Completion]) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage(cs)}

    def full(self, cs: Sequence[Completion]) -> dict:
        """The whole response: one choice per completion (``n``), in order."""
        choices = []
        for i, c in enumerate(cs):
            logprobs = self.logprobs(c.logprobs)
            if self.chat:
                message: dict = {"role": "assistant", "content": c.text}
                if c.tool_calls:
                    message = {"role": "assistant", "content": c.text or None, "tool_calls": list(c.tool_calls)}
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        body = self._head("chat.completion" if self.chat else "text_completion")
        st = cs[0].stats
        return body | {"choices": choices, "usage": usage(cs), "specdeploy": {
            "tokens_per_s": round(st.tokens_per_s, 3), "tau": round(st.mean_accepted, 4), "steps": st.steps}}


def usage(cs: Sequence[Completion]) -> dict:
    """The prompt once, and every choice's completion tokens."""
    p, n = cs[0].stats.prompt_tokens, sum(c.stats.new_tokens for c in cs)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace") + b"\n\n"
