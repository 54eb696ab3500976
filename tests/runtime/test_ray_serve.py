"""``specdeploy serve --ray``: N engines as one Ray Serve deployment on a local Ray, on loopback.

Two replicas on this machine's cores, through the OpenAI client: chat, streamed chat and completion;
a replica killed mid-load (its requests finish on the other replica or get a clean error, and Serve
starts a new one); SIGTERM drains and stops everything Ray started.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'specdeploy[ray]')")
openai = pytest.importorskip("openai")

from serving import RayServer, free_port, ray_pids, replica_pids


@pytest.fixture(scope="module")
def ray_server(tiny_bundle, tmp_path_factory):
    srv = RayServer(tiny_bundle, tmp_path_factory.mktemp("ray") / "serve.log", "--replicas", "2",
                    "--max-batch", "4", "--shutdown-timeout", "5")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_two_replicas_answer_chat_stream_and_completion_through_the_openai_client(ray_server):
    pids = replica_pids()
    assert len(pids) == 2
    # Each replica is pinned to its own share of the cores.
    shares = [os.sched_getaffinity(pid) for pid in pids]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not (shares[0] & shares[1]), shares
    c = ray_server.client
    chat = c.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "Say hi."}], max_tokens=12,
                                     temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 12
    assert chat.choices[0].finish_reason == "length"
    parts = list(c.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=12, temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    comp = c.completions.create(model="bundle", prompt="one two three", max_tokens=8, temperature=0)
    assert comp.usage.completion_tokens == 8 and comp.choices[0].text
    # The single-process server's errors, through the proxy.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=ray_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=17)
    # Requests reach both replicas: each one's /metrics counts its own.
    seen = {httpx.get(ray_server.url + "/health", timeout=5).json().get("pid") for _ in range(40)}
    assert len(seen) == 2


def test_a_replica_killed_mid_load_is_replaced_and_no_request_hangs(ray_server):
    c = ray_server.client
    victim = replica_pids()[0]

    def ask(i: int):
        try:
            r = c.chat.completions.create(model="bundle", messages=[{"role": "user", "content": f"Count to {i}."}],
                                          max_tokens=300, temperature=0)
            return ("ok", r.choices[0].finish_reason)
        except openai.APIStatusError as exc:
            return ("error", exc.status_code)
        except openai.APIConnectionError:
            return ("error", "connection")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    assert all(kind == "ok" and why == "length" or kind == "error" and why in (500, 502, 503)
               for kind, why in results), results
    assert any(kind == "ok" for kind, _ in results), results  # the other replica kept serving
    assert ray_server.wait_ready(180, replicas=2), ray_server.log()[-3000:]  # Serve replaced it
    assert victim not in replica_pids()
    for i in range(4):
        r = c.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens == 4


def test_sigterm_drains_and_leaves_nothing_running(ray_server):
    def ask() -> int:
        r = ray_server.client.chat.completions.create(
            model="bundle", messages=[{"role": "user", "content": "Tell a story."}], max_tokens=200, temperature=0)
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ask) for _ in range(2)]
        time.sleep(0.5)
        assert ray_server.stop() == 0  # the replicas drain: requests in flight finish first
        assert [f.result(timeout=60) for f in futures] == [200, 200]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (ray_pids() - ray_server.before):
        time.sleep(0.5)
    assert not (ray_pids() - ray_server.before), ray_server.log()[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(ray_server.url + "/health", timeout=2)


def test_autoscaling_adds_a_replica_under_load(tiny_bundle, tmp_path):
    srv = RayServer(tiny_bundle, tmp_path / "serve.log", "--replicas", "1", "--max-replicas", "2",
                    "--target-ongoing", "1", "--cpus-per-replica", "1", "--max-batch", "2", replicas=1)
    try:
        assert len(replica_pids()) == 1
        stop = time.monotonic() + 120

        def load_loop() -> None:  # three clients in a row: three requests in flight against a target of one
            while time.monotonic() < stop and len(replica_pids()) < 2:
                srv.client.completions.create(model="bundle", prompt="one two", max_tokens=200, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for f in [pool.submit(load_loop) for _ in range(3)]:
                f.result(timeout=180)
        assert len(replica_pids()) == 2, srv.log()[-3000:]
        assert srv.wait_ready(120, replicas=2)
    finally:
        assert srv.stop() == 0


def test_a_replica_that_cannot_load_fails_the_deploy_in_one_sentence(tiny_bundle, tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine can run the ort-cuda backend")
    before = ray_pids()
    proc = subprocess.run([sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(tiny_bundle), "--ray",
                           "--replicas", "1", "--backend", "ort-cuda", "--port", str(free_port())],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: The Ray Serve deployment failed: ONNX Runtime's CUDAExecutionProvider is not "
                           "available"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (ray_pids() - before):
        time.sleep(0.5)
    assert not (ray_pids() - before)


def test_ray_options_without_ray_or_out_of_order_are_one_sentence(tiny_bundle):
    from click.testing import CliRunner
    from specdeploy.exporter.cli import main

    res = CliRunner().invoke(main, ["serve", str(tiny_bundle), "--replicas", "3", "--ray-address", "auto"])
    assert res.exit_code == 2 and "Error: Without --ray, --replicas, --ray-address cannot be used." in res.output
    res = CliRunner().invoke(main, ["serve", str(tiny_bundle), "--ray", "--replicas", "3", "--max-replicas", "2"])
    assert res.exit_code == 2 and "Error: --max-replicas (2) is below --replicas (3)." in res.output
    res = CliRunner().invoke(main, ["serve", "/nonexistent/bundle", "--ray"])
    assert res.exit_code == 1 and res.output.startswith("Error: ") and res.output.count("\n") == 1
