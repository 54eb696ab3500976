"""An OpenAI-compatible HTTP server over one :class:`Engine`: ``specdeploy serve BUNDLE``.

    POST /v1/completions        POST /v1/chat/completions   (``"stream": true`` -> server-sent events)
    GET  /v1/models             GET  /health                GET  /metrics (Prometheus text format)

Built on Starlette and uvicorn, imported only here so that ``import specdeploy.runtime`` stays lean.
Each request runs its generation in a worker thread, and the event loop only moves bytes. The engine
decodes up to ``max_batch`` requests together (continuous batching; with 1, one decode slot), the rest
queue in arrival order. When a client disconnects, its stream is closed: a queued request leaves the
queue and a running one stops after the current decode step, so its slot or batch row goes to the
next request. Requests are validated with strict pydantic models (no type coercion,
unknown fields rejected) and every failure is an OpenAI-style error body.

Served as OpenAI's: ``n`` (up to 16), ``logprobs``/``top_logprobs``, ``response_format`` (json_object,
json_schema), ``tools``/``tool_choice`` (``runtime/tools.py``), ``stream_options.include_usage``; as vLLM spells
them, ``guided_regex`` and ``guided_grammar``. Differences, on purpose: one prompt per completion request, no
penalties or ``logit_bias``, a streamed answer's tool calls come whole in one chunk at its end, and a request
whose prompt plus ``max_tokens`` runs past the bundle's context ends there with ``finish_reason: "length"``
instead of being refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .engine import Completion, Engine, TextStream
from .errors import SpecDeployError
from .grammar import GrammarError
from .server_front import FrontDoor
from .server_metrics import Metrics
from .tools import ToolError

try:
    import uvicorn  # noqa: F401 (run by .server_run; checked here with the rest of the extra)
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from .server_schema import (
        ApiError,
        ChatRequest,
        CompletionRequest,
        GenerationRequest,
        ResponseShape,
        check_supported,
        error_body,
        logprobs_asked,
        parse_request,
        sse,
    )
except ImportError as _exc:  # the server stack is an optional extra
    raise SpecDeployError(
        f"`specdeploy serve` needs the server extra ({_exc.name} is missing): pip install 'specdeploy[serve]'."
    ) from None

log = logging.getLogger("specdeploy.server")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # id on /v1/models; default: the bundle folder's name
    api_key: str | None = None
    max_prompt_tokens: int | None = None  # default: the bundle's context - 1
    max_tokens_limit: int | None = None  # default: the bundle's context
    max_body_bytes: int = 1_000_000
    max_queue: int = 64  # admitted generation requests (running + queued); more get a 503
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on SIGTERM/SIGINT
    cache_per_user: bool = False  # the suffix draft's shared cache kept apart per request "user" field


_DONE = object()


def _exhaust(stream: TextStream) -> Completion | None:
    for _ in stream:
        pass
    return stream.completion


async def _until_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the client going away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- metrics -------------------------------------------------------------------------------------


# --- the application -----------------------------------------------------------------------------
class AppServer:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_id = config.model_name or engine.bundle_dir.resolve().name
        context = engine.max_context
        self.max_prompt_tokens = min(config.max_prompt_tokens or context - 1, context - 1)
        self.max_tokens_limit = config.max_tokens_limit or context
        self.metrics = Metrics()
        self.closing = False
        self._cancel_timer: asyncio.TimerHandle | None = None
        # One thread per admitted request: queued ones block in the engine's FIFO, so size it to the queue.
        self.pool = ThreadPoolExecutor(max_workers=config.max_queue, thread_name_prefix="specdeploy-gen")

    # --- plumbing ---
    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = ApiError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                           code="request_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "The client went away while sending the request body.") from None
        return b"".join(chunks)

    def _admit(self) -> None:
        if self.closing or self.engine.closed:
            raise ApiError(503, "The server is shutting down.", code="shutting_down")
        if self.metrics.in_flight >= self.config.max_queue:
            raise ApiError(503, f"The server is overloaded ({self.metrics.in_flight} requests in flight); "
                                "retry shortly.", code="overloaded")
        self.metrics.in_flight += 1

    def _release(self) -> None:
        self.metrics.in_flight -= 1

    # --- endpoints ---
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await self._body(request))
        prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0] if req.prompt else ""
        return await self._generate(request, req, prompt=prompt, messages=None,
                                    max_tokens=req.max_tokens or 16)  # 16: OpenAI's default for completions

    async def chat(self, request: Request) -> Response:
        req: ChatRequest = parse_request(ChatRequest, await self._body(request))
        messages = req.chat_messages()
        max_tokens = req.max_completion_tokens or req.max_tokens or self.max_tokens_limit
        return await self._generate(request, req, prompt=None, messages=messages, max_tokens=max_tokens)

    async def _generate(self, request: Request, req: GenerationRequest, prompt: str | None,
                        messages: list[dict] | None, max_tokens: int) -> Response:
        if req.model != self.model_id:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_id}'.",
                           param="model", code="model_not_found")
        check_supported(req)
        logprobs = logprobs_asked(req)
        if max_tokens > self.max_tokens_limit:
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise ApiError(400, f"{param} is {max_tokens} but this server allows at most {self.max_tokens_limit}.",
                           param=param, code="invalid_value")
        self._admit()
        handed_off = False
        try:
            streams = await self._start(req, prompt, messages, max_tokens, logprobs)
            shape = ResponseShape(messages is not None, self.model_id,
                                  bool(req.stream_options and req.stream_options.include_usage), self.engine.fingerprint,
                                  None if logprobs is None else self._token_text)
            if req.stream:
                handed_off = True  # the response releases the admission when it ends, however it ends
                end = self._stream_end(request, streams)
                return _EventStream(self._events(request, streams, shape, end), end)
            completions = await self._drain(request, streams)
            if completions is None:
                return Response(status_code=499)  # the client went away; nobody reads this
            request.scope["specdeploy.tokens"] = sum(c.stats.new_tokens for c in completions)
            if any(c.finish_reason == "cancelled" for c in completions):
                raise ApiError(503, "The server is shutting down.", code="shutting_down")
            return JSONResponse(shape.full(completions))
        finally:
            if not handed_off:
                self._release()

    async def _start(self, req: GenerationRequest, prompt: str | None, messages: list[dict] | None, max_tokens: int,
                     logprobs: int | None) -> list[TextStream]:
        """The request's ``n`` generations, queued for the engine (choice ``i`` samples with ``seed + i``, so that
        choice 0 is the answer ``n=1`` gives), or one sentence as an ``ApiError``; nothing is left running."""
        streams: list[TextStream] = []
        try:
            for i in range(req.n):
                streams.append(await run_in_threadpool(
                    self.engine.stream, prompt, messages, max_new_tokens=max_tokens, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stop=[req.stop] if isinstance(req.stop, str) else req.stop or (),
                    seed=None if req.seed is None else (req.seed + i) % (1 << 64),
                    cache_namespace=(req.user or "") if self.config.cache_per_user else "", logprobs=logprobs,
                    **req.constraint(), **(req.tool_options() if isinstance(req, ChatRequest) else {})))
            if streams[0].prompt_tokens > self.max_prompt_tokens:
                raise ApiError(400, f"The prompt has {streams[0].prompt_tokens} tokens but this server accepts at most "
                                    f"{self.max_prompt_tokens}.", param="messages" if messages else "prompt",
                               code="context_length_exceeded")
        except (GrammarError, ToolError) as exc:
            for stream in streams:
                stream.close()
            param = exc.param if isinstance(exc, ToolError) else req.constraint_param()
            raise ApiError(400, str(exc), param=param, code="invalid_value") from None
        except SpecDeployError as exc:
            for stream in streams:
                stream.close()
            if self.engine.closed:
                raise ApiError(503, "The server is shutting down.", code="shutting_down") from None
            raise ApiError(400, str(exc), param="messages" if messages else "prompt") from None
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    def _token_text(self, token: int) -> str:
        return self.engine.codec.decode([token], skip_special_tokens=False)

    async def _drain(self, request: Request, streams: list[TextStream]) -> list[Completion] | None:
        """Run whole generations in worker threads; None if the client disconnected first."""
        loop = asyncio.get_running_loop()
        work = asyncio.gather(*(loop.run_in_executor(self.pool, _exhaust, s) for s in streams))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            self.metrics.disconnects += 1
            request.scope["specdeploy.tokens"] = sum(s.stats.new_tokens for s in streams)
            request.scope["specdeploy.note"] = " client-disconnected"
            return None
        finally:
            gone.cancel()
            for stream in streams:
                stream.close()  # a no-op once finished; otherwise frees the slot (disconnect or shutdown)

    def _stream_end(self, request: Request, streams: list[TextStream]) -> Callable[[bool], None]:
        """Cleanup for one streamed response; runs once, from the body or from the response if no body ran."""
        ended = False

        def end(finished: bool) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            for stream in streams:
                stream.close()  # a no-op once finished; otherwise frees the slot
            self._release()
            if not finished:
                self.metrics.disconnects += 1
                request.scope["specdeploy.tokens"] = sum(s.stats.new_tokens for s in streams)
                request.scope["specdeploy.note"] = " client-disconnected"

        return end

    async def _events(self, request: Request, streams: list[TextStream], shape: ResponseShape,
                      end: Callable[[bool], None]) -> AsyncIterator[bytes]:
        """Server-sent events, choice ``i``'s chunks carrying index ``i``; Starlette cancels this generator when the
        client disconnects."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item: tuple[int, object]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (hard shutdown)
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def work(i: int) -> None:
            try:
                for delta in streams[i]:
                    push((i, delta))
                push((i, _DONE))
            except Exception as exc:  # noqa: BLE001 - handed to the event loop, which logs it
                push((i, exc))

        finished = False
        sent = [0] * len(streams)  # per choice: log-probabilities sent (tokens), and the text before the next one's
        offset = [0] * len(streams)

        def logprobs(i: int, upto: int) -> dict | None:  # choice i's, of the tokens decoded since its last chunk
            entries = streams[i].stats.logprobs[sent[i]:upto]
            body = shape.logprobs(entries, offset[i])
            sent[i] += len(entries)
            if body is not None and not shape.chat:  # completions' text_offset: the texts the body already decoded
                offset[i] += sum(len(t) for t in body["tokens"])
            return body

        try:
            for i in range(len(streams)):
                self.pool.submit(work, i)
                if shape.chat:
                    yield sse(shape.chunk(None, role=True, index=i))
            done = 0
            item = None
            while done < len(streams):
                i, value = item if item is not None else await queue.get()
                item = None
                if isinstance(value, str):
                    parts = [value]
                    while not queue.empty():  # coalesce this choice's deltas that piled up while we were writing
                        item = queue.get_nowait()
                        if item[0] != i or not isinstance(item[1], str):
                            break
                        parts.append(item[1])
                        item = None
                    yield sse(shape.chunk("".join(parts), logprobs=logprobs(i, len(streams[i].stats.logprobs)),
                                          index=i))
                    continue
                if isinstance(value, BaseException):
                    log.error("generation failed", exc_info=value)
                    yield sse(error_body("The generation failed; see the server log.", "server_error"))
                    break
                c = streams[i].completion
                assert c is not None
                request.scope["specdeploy.tokens"] = sum(s.stats.new_tokens for s in streams)
                if c.finish_reason == "cancelled":  # engine closed under us: shutdown
                    request.scope["specdeploy.note"] = " cancelled-at-shutdown"
                    yield sse(error_body("The server is shutting down.", "server_error", code="shutting_down"))
                    break
                if c.tool_calls:
                    yield sse(shape.tool_calls_chunk(c.tool_calls, index=i))
                yield sse(shape.chunk(None if shape.chat else "", finish_reason=c.finish_reason, index=i,
                                      logprobs=logprobs(i, len(c.token_ids)) if sent[i] < len(c.token_ids) else None))
                done += 1
            if done == len(streams) and shape.include_usage:
                yield sse(shape.usage_chunk([s.completion for s in streams]))
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            end(finished)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": int(time.time()), "owned_by": "specdeploy",
             "max_model_len": self.engine.max_context}]})

    async def health(self, request: Request) -> Response:
        st = self.engine.stats()
        status = "shutting down" if self.closing or self.engine.closed else "ok"
        plan = self.engine.plan
        return JSONResponse({"status": status, "model": self.model_id, "queue_depth": st.queue_depth,
                             "running": st.running, "max_batch": self.engine.max_batch,
                             "batching": self.engine.batch_reason, "draft": self.engine.draft_name,
                             "lossy": plan.lossy, "step_plan": plan.reason, "pid": os.getpid()},
                            status_code=200 if status == "ok" else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(self.engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- lifetime ---
    def begin_shutdown(self, timeout: float) -> None:
        """uvicorn stopped accepting: refuse new work now, and after ``timeout`` s cancel what is left.

        Closing the engine ends queued and running streams cleanly (an SSE error event, a 503 for
        non-streaming requests), so their connections close before uvicorn's own, harder deadline.
        """
        self.closing = True
        loop = asyncio.get_running_loop()
        self._cancel_timer = loop.call_later(timeout, lambda: loop.run_in_executor(None, self.engine.close))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        # Every connection is closed by now; closing the engine (again) lets the worker threads end.
        self.closing = True
        if self._cancel_timer is not None:
            self._cancel_timer.cancel()
        await run_in_threadpool(self.engine.close)
        await run_in_threadpool(self.pool.shutdown, True, cancel_futures=True)


class _EventStream(StreamingResponse):
    """An SSE response whose cleanup also runs when its body never started (client gone before the first byte)."""

    def __init__(self, body: AsyncIterator[bytes], end: Callable[[bool], None]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end(False)


def create_app(engine: Engine, config: ServerConfig = ServerConfig()) -> Any:
    """The ASGI application serving ``engine``; closing the app (lifespan shutdown) closes the engine."""
    return build_app(AppServer(engine, config))


def build_app(server: AppServer) -> Any:
    """The routes and error handlers over ``server``, behind the front door (API key, metrics, log line)."""

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this, so uvicorn still logs the traceback: a bug stays visible.
        return JSONResponse(error_body("Internal server error.", "server_error"), 500)

    app = Starlette(
        routes=[
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.prometheus, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error},
        lifespan=server.lifespan,
    )
    return FrontDoor(app, server.config.api_key, server.metrics)
