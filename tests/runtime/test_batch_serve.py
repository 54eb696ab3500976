"""`specdeploy serve` with continuous batching (the default where the bundle allows it) and `bench-serve`:
concurrent answers equal to each prompt's answer alone, disconnects free a row, SIGTERM under load loses
nothing, and the serving bench writes its JSON and plot."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from serving import PROMPTS, Server, long_stream, sse_text, wait_for


@pytest.fixture(scope="module")
def batched(tiny_bundle, tmp_path_factory):
    srv = Server(tiny_bundle, tmp_path_factory.mktemp("serve-batch") / "server.log", "--shutdown-timeout", "2")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_default_server_batches_and_says_so(batched):
    health = httpx.get(batched.url + "/health").json()
    if health["max_batch"] == 32:  # where the probe found a sequence's rows the same among others' (this CPU's kernels)
        assert "exact batching" in health["batching"] and "[plan] exact batching" in batched.log()
    else:  # else one request at a time, exactly, said in one line at start
        assert health["max_batch"] == 1 and health["batching"].startswith("one request at a time")
        assert batched.log().count("warning: Batching is off:") == 1


def test_32_concurrent_clients_get_their_answers_alone(batched):
    model = httpx.get(batched.url + "/v1/models").json()["data"][0]["id"]

    def body(i: int) -> tuple[str, dict]:
        common = {"model": model, "max_tokens": 48, "temperature": 0, "stream": bool(i % 3)}
        if i % 2:
            return "/v1/chat/completions", common | {"messages": [{"role": "user", "content": PROMPTS[i % 8]}]}
        return "/v1/completions", common | {"prompt": PROMPTS[i % 8]}

    async def one(client: httpx.AsyncClient, i: int) -> str:
        path, payload = body(i)
        if not payload["stream"]:
            r = await client.post(path, json=payload)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"] if "text" in choice else choice["message"]["content"]
        async with client.stream("POST", path, json=payload) as r:
            assert r.status_code == 200, await r.aread()
            text, _, done = sse_text([line async for line in r.aiter_lines()])
        assert done
        return text

    async def run(ids: list[int]) -> list[str]:
        limits = httpx.Limits(max_connections=len(ids), max_keepalive_connections=len(ids))
        async with httpx.AsyncClient(base_url=batched.url, limits=limits, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in ids)), timeout=180)

    alone = {}
    for i in range(16):  # every (endpoint, prompt) pair once, one at a time
        alone[i] = asyncio.run(run([i]))[0]
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], httpx.get(batched.url + "/health").json()["running"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        texts = asyncio.run(run(list(range(32))))
    finally:
        stop.set()
        watcher.join()
    assert [texts[i] for i in range(32)] == [alone[i % 16] for i in range(32)]
    assert peak[0] > 1  # they really shared steps
    assert wait_for(lambda: batched.metrics()["specdeploy_requests_in_flight"] == 0, 10)


def test_a_disconnect_frees_its_row(batched):
    model = httpx.get(batched.url + "/v1/models").json()["data"][0]["id"]
    m0 = batched.metrics()
    long = {"model": model, "prompt": "Tell me everything.", "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", batched.url + "/v1/completions", json=long) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    assert wait_for(lambda: batched.metrics()["specdeploy_generations_cancelled_total"]
                     == m0["specdeploy_generations_cancelled_total"] + 1, 10)
    assert wait_for(lambda: batched.metrics()["specdeploy_generation_running"] == 0, 10)


def test_sigterm_under_batched_load_loses_nothing(tiny_bundle, tmp_path):
    srv = Server(tiny_bundle, tmp_path / "server.log", "--shutdown-timeout", "1", "--max-batch", "4")
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    results: dict[int, object] = {}
    started = threading.Event()

    def stream(i: int) -> None:
        results[i] = long_stream(srv.url, model, PROMPTS[i % 8], started)

    def plain(i: int) -> None:
        payload = {"model": model, "prompt": PROMPTS[i % 8], "max_tokens": 480, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=payload, timeout=60)
        results[i] = (r.status_code, r.json())

    n = 12
    threads = [threading.Thread(target=stream if i % 2 else plain, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert started.wait(30)
    assert wait_for(lambda: srv.metrics()["specdeploy_requests_in_flight"] + len(results) >= n, 30)
    assert srv.stop(timeout=30) in (0, -signal.SIGTERM)
    for t in threads:
        t.join(10)
    assert len(results) == n
    for i, res in results.items():
        if i % 2:  # streamed: finished, or a clean error event, and always [DONE]
            _, events, done = res
            assert done
            assert any("error" in ev for ev in events) or events[-1]["choices"][0]["finish_reason"] == "length"
        else:  # not streamed: the whole answer, or a clean 503
            status, body = res
            assert (status == 200 and body["choices"][0]["finish_reason"] == "length") or \
                (status == 503 and body["error"]["code"] == "shutting_down"), (status, body)
    assert "Traceback" not in srv.log() and "Finished server process" in srv.log()


def test_bench_serve_writes_json_and_plot(tiny_bundle, tmp_path, monkeypatch):
    from click.testing import CliRunner
    from specdeploy.exporter.bench import serve
    from specdeploy.exporter.cli import main

    started = []
    popen = serve.subprocess.Popen

    def spy(argv, *args, **kwargs):
        started.append(argv)
        return popen(argv, *args, **kwargs)

    monkeypatch.setattr(serve.subprocess, "Popen", spy)
    turns = []  # (max_batch, clients) of each timed run above one client, in the order they ran
    concurrent = serve._concurrent

    def spy_runs(server, prompts, clients, *args):
        turns.append((server.port, clients))
        return concurrent(server, prompts, clients, *args)

    monkeypatch.setattr(serve, "_concurrent", spy_runs)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "odd" if i % 2 else "even"}) + "\n"
                               for i, p in enumerate(PROMPTS[:4])))
    out = tmp_path / "serve.json"
    res = CliRunner().invoke(main, ["bench-serve", str(tiny_bundle), "--max-batch", "1:none,4", "--concurrency", "1,3,6",
                                    "--max-new-tokens", "8", "--prompts", str(prompts), "--json", str(out),
                                    "--draft", "prompt-lookup", "--suffix-cache-tokens", "0", "--repeats", "2"])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    servers = [argv for argv in started if "serve" in argv]
    assert len(servers) == 2 and all(argv[-2:] == ["--suffix-cache-tokens", "0"] for argv in servers)
    assert report["suffix_cache_tokens"] == 0 and report["repeats"] == 2
    # each level twice per server, taking turns A B B A (a steady drift falls on both alike)
    batch_of = {int(argv[argv.index("--port") + 1]): int(argv[argv.index("--max-batch") + 1]) for argv in servers}
    assert [(batch_of[port], c) for port, c in turns] == [(1, 3), (4, 3), (4, 3), (1, 3), (1, 6), (4, 6), (4, 6), (1, 6)]
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert [(s["max_batch"], s["draft"]) for s in report["servers"]] == [(1, "none"), (4, "prompt-lookup")]
    for srv in report["servers"]:
        assert [r["clients"] for r in srv["runs"]] == [1, 3, 6]
        for r in srv["runs"]:  # every answer the plain server's: drafts and batching change none
            assert r["identical_to_alone"] == r["identical_to_first"] == r["complete"] == r["requests"]
            assert r["tokens_per_s"] > 0
            # every prompt at every concurrency, asked again in turn where the clients outnumber them, per repeat
            repeats = 1 if r["clients"] == 1 else 2
            assert r["requests"] == max(4, r["clients"]) * repeats and len(r["repeat_tokens_per_s"]) == repeats
            reps = r["repeat_tokens_per_s"]  # the pooled rate lies within its repeats' rates
            assert min(reps) - 0.01 <= r["tokens_per_s"] <= max(reps) + 0.01
            assert r["p50_latency_s"] <= r["p95_latency_s"]
            cats = r["categories"]  # each category apart: the file's records name theirs
            assert set(cats) == {"even", "odd"} and sum(c["requests"] for c in cats.values()) == r["requests"]
            assert all(c["tokens_per_s_per_request"] > 0 for c in cats.values())
    assert "vs_first" in report["servers"][1]["runs"][1] and report["machine"]["cpu_model"]
    first, second = ([r["repeat_tokens_per_s"] for r in srv["runs"]] for srv in report["servers"])
    assert [v["vs_first"]["repeat_tokens_per_s"] for v in report["servers"][1]["runs"]] == \
        [[round(a / b, 3) for a, b in zip(x, y)] for x, y in zip(second, first)]
    assert "over 2 repeats]" in res.output
    assert " even " in res.output
    assert "machine:" in res.output

    bad = CliRunner().invoke(main, ["bench-serve", str(tmp_path / "missing")])
    assert bad.exit_code == 1 and bad.output.startswith("Error:") and bad.output.count("\n") == 1
    both = CliRunner().invoke(main, ["bench-serve", str(tiny_bundle), "--prompts", str(prompts), "--prompt-set", "math"])
    assert both.exit_code == 1 and "not both" in both.output and both.output.count("\n") == 1
