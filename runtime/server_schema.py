"""The OpenAI-compatible server's shapes: strict pydantic request schemas, OpenAI-style errors, and the
response and stream-chunk bodies.

Imported only by :mod:`specdeploy.runtime.server` (the ``serve`` extra), never by the lean runtime.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from .engine import Completion

_MAX_STOP_CHARS = 256


# --- request schema ------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


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


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


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
    fields = set(ChatMessage.model_fields) | set(TextPart.model_fields) | set(StreamOptions.model_fields)
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
        ("n", req.n != 1, "Only n=1 is supported."),
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
            ("logprobs", req.logprobs is not None, "logprobs are not supported."),
            ("suffix", req.suffix is not None, "suffix is not supported."),
        ]
    if isinstance(req, ChatRequest):
        checks += [
            ("logprobs", bool(req.logprobs), "logprobs are not supported."),
            ("top_logprobs", req.top_logprobs is not None, "top_logprobs are not supported."),
        ]
    for param, bad, msg in checks:
        if bad:
            raise ApiError(400, msg, param=param, code="unsupported_value")


# --- response shapes -----------------------------------------------------------------------------
class ResponseShape:
    """How one endpoint's responses and stream chunks look."""

    def __init__(self, chat: bool, model: str, include_usage: bool, fingerprint: str = ""):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.fingerprint = fingerprint  # the engine's (Engine.fingerprint): says whether answers are exact
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def chunk(self, delta: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            d: dict = {} if delta is None else {"content": delta}
            if role:
                d = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion") | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, c: Completion) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage(c)}

    def full(self, c: Completion) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            body = self._head("text_completion")
        st = c.stats
        return body | {"choices": [choice], "usage": usage(c), "specdeploy": {
            "tokens_per_s": round(st.tokens_per_s, 3), "tau": round(st.mean_accepted, 4), "steps": st.steps}}


def usage(c: Completion) -> dict:
    p, n = c.stats.prompt_tokens, c.stats.new_tokens
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace") + b"\n\n"
