"""End to end against a real `specdeploy serve` process on loopback: the official openai client, raw HTTP
error cases, a malformed-input sweep, client disconnects, a bounded 32-client load test and shutdown."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest
from serving import PROMPTS, Server, long_stream, sse_text, wait_for

KEY = "sk-test-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
REQUEST_LINE = re.compile(r"specdeploy\.server: POST /v1/(chat/)?completions \d{3} tokens=\d+ [\d.]+s")


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    srv = Server(tiny_bundle, tmp_path_factory.mktemp("serve") / "server.log", "--api-key", KEY,
                 "--max-prompt-tokens", "200", "--max-tokens-limit", "480", "--max-body-bytes", "20000",
                 "--shutdown-timeout", "2", "--max-batch", "1")  # the one-slot server; batching: test_batch_serve
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _chat(i: int) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[i]}]


# --- openai client ----------------------------------------------------------------------------
def test_models_health_metrics(server, model_id):
    assert model_id == "bundle"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and not health["lossy"] and "step plan" in health["step_plan"]  # no key needed
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdeploy_requests_total", "specdeploy_errors_total", "specdeploy_generated_tokens_total",
                 "specdeploy_tokens_per_second", "specdeploy_tau", "specdeploy_queue_depth",
                 "specdeploy_client_disconnects_total"):
        assert f"# TYPE {name} " in text
    sample = re.compile(r"^[a-z_]+(\{[a-z_]+=\"[^\"]*\"(,[a-z_]+=\"[^\"]*\")*\})? -?[0-9.e+-]+$")
    assert all(sample.match(line) for line in text.splitlines() if not line.startswith("#"))


def test_completion_matches_in_process(client, model_id, plain_engine):
    ref = plain_engine.generate(PROMPTS[0], max_new_tokens=24)
    out = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == ref.stats.prompt_tokens and out.usage.completion_tokens == 24

    chunks = list(client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_matches_in_process(client, model_id, plain_engine):
    ref = plain_engine.generate(messages=_chat(1), max_new_tokens=20)
    out = client.chat.completions.create(model=model_id, messages=_chat(1), max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.total_tokens == ref.stats.prompt_tokens + ref.stats.new_tokens

    chunks = list(client.chat.completions.create(model=model_id, messages=_chat(1), max_completion_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_stop_sequence(client, model_id, plain_engine):
    full = plain_engine.generate(PROMPTS[2], max_new_tokens=24).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    out = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, model_id):
    kw = {"model": model_id, "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


# --- raw HTTP errors ----------------------------------------------------------------------------
def _assert_error(r: httpx.Response, status: int, param: str | None = "", code: str | None = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param != "":
        assert err["param"] == param
    if code != "":
        assert err["code"] == code
    return err


def test_api_key(server, model_id):
    body = {"model": model_id, "prompt": "hi", "max_tokens": 2}
    _assert_error(httpx.post(server.url + "/v1/completions", json=body), 401, code="invalid_api_key")
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.headers["www-authenticate"] == "Bearer"
    _assert_error(r, 401, code="invalid_api_key")
    _assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).status_code == 200


def test_bad_field_is_400_not_422(server, model_id):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH,
                   json={"model": model_id, "prompt": "hi", "max_tokens": "16"})
    err = _assert_error(r, 400, param="max_tokens")
    assert err["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH,
                   json={"model": model_id, "messages": [{"role": "user", "content": "hi", "mood": "x"}]})
    _assert_error(r, 400, param="messages[0].mood")


def test_limits(server, model_id):
    url = server.url + "/v1/completions"
    big = {"model": model_id, "prompt": "word " * 5000}
    _assert_error(httpx.post(url, headers=AUTH, json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "bundle", "prompt": "'
        for _ in range(30):
            yield b"x" * 1000
        yield b'"}'

    _assert_error(httpx.post(url, headers=AUTH, content=chunks()), 413)
    long_prompt = {"model": model_id, "prompt": " ".join(["cat"] * 400), "max_tokens": 4}  # ~400 tokens > 200
    _assert_error(httpx.post(url, headers=AUTH, json=long_prompt), 400, param="prompt",
                  code="context_length_exceeded")
    _assert_error(httpx.post(url, headers=AUTH, json={"model": model_id, "prompt": "hi", "max_tokens": 481}),
                  400, param="max_tokens")
    _assert_error(httpx.post(url, headers=AUTH, json={"model": "gpt-4", "prompt": "hi"}), 404,
                  code="model_not_found")


def test_malformed_input_sweep(server, model_id):
    comp, chat = server.url + "/v1/completions", server.url + "/v1/chat/completions"
    m = model_id
    cases: list[tuple[str, bytes]] = [
        (comp, b""), (comp, b"not json"), (comp, b"[]"), (comp, b"null"), (comp, b'"a string"'),
        (comp, b'{"model": "' + m.encode() + b'", "prompt": "\xff\xfe\xfd"}'),  # invalid UTF-8
        (chat, b'{"model": "' + m.encode() + b'", "messages": [{"role": "user", "content": "\xc3\x28"}]}'),
        (comp, b'{"model": "x", "prompt": ' + b"[" * 8000 + b"]" * 8000 + b"}"),  # deep nesting
    ]
    bodies: list[tuple[str, dict]] = [
        (comp, {"model": m}), (comp, {"prompt": "hi"}), (comp, {"model": m, "prompt": 5}),
        (comp, {"model": m, "prompt": ""}), (comp, {"model": m, "prompt": []}),
        (comp, {"model": m, "prompt": ["a", "b"]}), (comp, {"model": m, "prompt": [1, 2, 3]}),
        (comp, {"model": m, "prompt": "hi", "max_tokens": -1}), (comp, {"model": m, "prompt": "hi", "max_tokens": 0}),
        (comp, {"model": m, "prompt": "hi", "max_tokens": 10**30}),
        (comp, {"model": m, "prompt": "hi", "max_tokens": 16.5}),
        (comp, {"model": m, "prompt": "hi", "temperature": "hot"}),
        (comp, {"model": m, "prompt": "hi", "temperature": 1e308}),
        (comp, {"model": m, "prompt": "hi", "temperature": -0.5}),
        (comp, {"model": m, "prompt": "hi", "top_p": 0}), (comp, {"model": m, "prompt": "hi", "top_k": -3}),
        (comp, {"model": m, "prompt": "hi", "seed": 10**40}), (comp, {"model": m, "prompt": "hi", "seed": "7"}),
        (comp, {"model": m, "prompt": "hi", "stop": 123}), (comp, {"model": m, "prompt": "hi", "stop": ["a"] * 5}),
        (comp, {"model": m, "prompt": "hi", "stream": "yes"}), (comp, {"model": m, "prompt": "hi", "n": 17}),
        (comp, {"model": m, "prompt": "hi", "logprobs": 6}), (comp, {"model": m, "prompt": "hi", "echo": True}),
        (chat, {"model": m, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}),
        (chat, {"model": m, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        (comp, {"model": m, "prompt": "hi", "unknown_field": 1}),
        (comp, {"model": m, "prompt": "hi", "stream_options": {"include_usage": True, "extra": 1}}),
        (chat, {"model": m, "messages": []}), (chat, {"model": m, "messages": "hello"}),
        (chat, {"model": m, "messages": [{"role": "wizard", "content": "x"}]}),
        (chat, {"model": m, "messages": [{"role": "user"}]}),
        (chat, {"model": m, "messages": [{"role": "user", "content": None}]}),
        (chat, {"model": m, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        (chat, {"model": m, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.0}),
        (chat, {"model": m, "messages": [{"role": "user", "content": "x"}], "tools": []}),
        (chat, {"model": m, "prompt": "hi"}),
    ]
    cases += [(url, json.dumps(body).encode()) for url, body in bodies]
    with httpx.Client(headers=AUTH, timeout=30) as c:
        for url, body in cases:
            r = c.post(url, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text[:200])
            assert r.json()["error"]["message"], body[:80]
        assert c.get(comp).status_code == 405
        assert c.get(server.url + "/v1/nope").status_code == 404
        assert c.get(server.url + "/health").status_code == 200
        ok = c.post(comp, json={"model": m, "prompt": "still alive?", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert server.metrics()["specdeploy_requests_in_flight"] == 0


# --- disconnects ----------------------------------------------------------------------------------


def test_disconnect_cancels_generation_and_frees_the_slot(server, model_id):
    url = server.url + "/v1/completions"
    long = {"model": model_id, "prompt": "Tell me everything.", "max_tokens": 480, "temperature": 0, "stream": True}
    m0 = server.metrics()
    with httpx.Client(headers=AUTH, timeout=30) as c:
        with c.stream("POST", url, json=long) as r:  # a running stream, closed after a few events
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break
        assert wait_for(lambda: server.metrics()["specdeploy_generations_cancelled_total"]
                         == m0["specdeploy_generations_cancelled_total"] + 1)
        m1 = server.metrics()
        assert m1["specdeploy_generated_tokens_total"] - m0["specdeploy_generated_tokens_total"] < 400
        t0 = time.monotonic()
        r = c.post(url, json={"model": model_id, "prompt": "next", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and time.monotonic() - t0 < 10

        # A queued stream whose client leaves must leave the queue; then its running peer too.
        with c.stream("POST", url, json=long) as running:
            lines = running.iter_lines()  # kept: dropping a half-read iterator closes the connection
            next(lines)  # generating now
            with c.stream("POST", url, json=long | {"prompt": "queued"}) as queued:
                assert queued.status_code == 200
                assert wait_for(lambda: server.metrics()["specdeploy_queue_depth"] == 1, 5)
            assert wait_for(lambda: server.metrics()["specdeploy_queue_depth"] == 0, 5)
        # Non-streaming: the client times out and goes away. Two long streams run and queue ahead of it,
        # so it cannot finish within its timeout however fast the machine decodes the tiny model.
        with c.stream("POST", url, json=long) as running, c.stream("POST", url, json=long | {"prompt": "q"}) as ahead:
            assert running.status_code == ahead.status_code == 200
            with pytest.raises(httpx.TimeoutException):
                c.post(url, json=long | {"stream": False}, timeout=0.05)
        assert wait_for(lambda: server.metrics()["specdeploy_requests_in_flight"] == 0)
        m2 = server.metrics()
        assert m2["specdeploy_client_disconnects_total"] - m0["specdeploy_client_disconnects_total"] >= 3
        assert m2["specdeploy_generations_cancelled_total"] - m0["specdeploy_generations_cancelled_total"] >= 3
        assert m2["specdeploy_generation_running"] == 0
        r = c.post(url, json={"model": model_id, "prompt": "next", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
    assert "client-disconnected" in server.log()


# --- load -----------------------------------------------------------------------------------------
def test_load_32_concurrent_streaming_clients(server, model_id):
    n_requests, n_clients, max_tokens = 64, 32, 16

    def body(i: int) -> tuple[str, dict]:
        common = {"model": model_id, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if i % 2:
            return "/v1/chat/completions", common | {"messages": _chat(i % len(PROMPTS))}
        return "/v1/completions", common | {"prompt": PROMPTS[i % len(PROMPTS)]}

    async def one(client: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> tuple[int, str, bool]:
        path, payload = body(i)
        async with sem, client.stream("POST", path, json=payload) as r:
            assert r.status_code == 200, await r.aread()
            text, _, done = sse_text([line async for line in r.aiter_lines()])
        return i, text, done

    async def run(ids: list[int], concurrency: int) -> list[tuple[int, str, bool]]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, limits=limits, timeout=120) as client:
            sem = asyncio.Semaphore(concurrency)
            return await asyncio.wait_for(asyncio.gather(*(one(client, sem, i) for i in ids)), timeout=150)

    def logged() -> int:
        return len(REQUEST_LINE.findall(server.log()))

    def settled() -> int:  # a request's line is written just after its last byte, so wait for quiet
        n = -1
        while n != logged():
            n = logged()
            time.sleep(0.3)
        return n

    # Single-client references: one request at a time, for each (endpoint, prompt) pair the load uses.
    reference = {i: text for i, text, _ in asyncio.run(run(list(range(len(PROMPTS))), 1))}
    logged_before = settled()
    rss_before = server.rss_mb()

    t0 = time.monotonic()
    results = asyncio.run(run(list(range(n_requests)), n_clients))
    elapsed = time.monotonic() - t0

    assert len(results) == n_requests and all(done for _, _, done in results)
    mismatched = [i for i, text, _ in results if text != reference[i % len(PROMPTS)]]
    assert not mismatched, f"outputs differ from the single-client output for requests {mismatched}"
    m = server.metrics()
    assert m["specdeploy_requests_in_flight"] == 0 and m["specdeploy_queue_depth"] == 0
    assert server.rss_mb() - rss_before < 200, (rss_before, server.rss_mb())
    assert wait_for(lambda: logged() - logged_before == n_requests, 5), (logged_before, logged())
    print(f"{n_requests} streamed requests, {n_clients} clients: {elapsed:.1f}s, "
          f"RSS {rss_before:.0f} -> {server.rss_mb():.0f} MB")


# --- CLI and shutdown -------------------------------------------------------------------------------
def test_serve_reports_a_bad_bundle_in_one_line(tmp_path):
    from click.testing import CliRunner
    from specdeploy.exporter.cli import main

    res = CliRunner().invoke(main, ["serve", str(tmp_path / "missing"), "--port", "1"])
    assert res.exit_code == 1 and res.output.startswith("Error:") and res.output.count("\n") == 1


def test_sigterm_finishes_or_cancels_in_flight_requests(tiny_bundle, tmp_path):
    srv = Server(tiny_bundle, tmp_path / "server.log", "--shutdown-timeout", "1", "--max-batch", "1", "--draft", "none")
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    results: dict[int, tuple[str, list[dict], bool]] = {}
    started = threading.Event()

    def stream(i: int) -> None:
        results[i] = long_stream(srv.url, model, PROMPTS[i % len(PROMPTS)], started)

    # Ten long requests, decoded plainly: the tiny model decodes 480 tokens in ~0.2 s on a fast core (faster with
    # drafts, as its outputs repeat), so fewer could all
    # finish within the 1 s shutdown timeout and leave nothing to cancel.
    n = 10
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert started.wait(30)
    # All admitted (running, queued or done) before the signal: a client still connecting when
    # the server stops gets "connection refused", which is not what this test is about.
    assert wait_for(lambda: srv.metrics()["specdeploy_requests_in_flight"] + len(results) >= n, 30)
    t0 = time.monotonic()
    assert srv.stop(timeout=30) in (0, -signal.SIGTERM)
    assert time.monotonic() - t0 < 15
    for t in threads:
        t.join(10)
    assert len(results) == n and all(done for _, _, done in results.values())  # each got a clean end
    ended = [any("error" in ev for ev in events) for _, events, _ in results.values()]
    assert any(ended), "queued requests past the shutdown timeout should have been cancelled"
    assert "Traceback" not in srv.log() and "Finished server process" in srv.log()
