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
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'specdeploy[ray]')")
openai = pytest.importorskip("openai")

from test_server import _free_port

KEY = "ray-test-key"


def _ray_pids() -> set[int]:
    """This user's processes that Ray started (its workers, raylet, GCS and the like)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ray::" in cmd or "/ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd:
            out.add(int(d.name))
    return out


def _replica_pids() -> list[int]:
    pids = []
    for pid in _ray_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ServeReplica" in cmd and "engine" in cmd:
            pids.append(pid)
    return sorted(pids)


class RayServer:
    def __init__(self, bundle: Path, log_path: Path, *args: str, replicas: int = 2):
        self.before = _ray_pids()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(bundle), "--ray", "--port",
                 str(self.port), "--api-key", KEY, *args], stdout=log, stderr=subprocess.STDOUT)
        if not self.wait_ready(240, replicas=replicas):
            self.proc.kill()
            pytest.fail(f"ray server did not start:\n{self.log()[-4000:]}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float, replicas: int) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                healthy = httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and len(_replica_pids()) >= replicas:
                return True
            time.sleep(0.5)
        return False

    def stop(self, timeout: float = 90) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running {timeout}s after SIGTERM:\n{self.log()[-3000:]}")


@pytest.fixture(scope="module")
def ray_server(tiny_bundle, tmp_path_factory):
    srv = RayServer(tiny_bundle, tmp_path_factory.mktemp("ray") / "serve.log", "--replicas", "2",
                    "--max-batch", "4", "--shutdown-timeout", "5")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_two_replicas_answer_chat_stream_and_completion_through_the_openai_client(ray_server):
    pids = _replica_pids()
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
        c.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3)
    # Requests reach both replicas: each one's /metrics counts its own.
    seen = {httpx.get(ray_server.url + "/health", timeout=5).json().get("pid") for _ in range(40)}
    assert len(seen) == 2


def test_a_replica_killed_mid_load_is_replaced_and_no_request_hangs(ray_server):
    c = ray_server.client
    victim = _replica_pids()[0]

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
    assert victim not in _replica_pids()
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
    while time.monotonic() < deadline and (_ray_pids() - ray_server.before):
        time.sleep(0.5)
    assert not (_ray_pids() - ray_server.before), ray_server.log()[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(ray_server.url + "/health", timeout=2)


@pytest.mark.slow
def test_real_model_replicas_answer_as_the_engine_does(real_bundle, tmp_path):
    from specdeploy.runtime import load

    messages = [{"role": "user", "content": "Name three prime numbers."}]
    srv = RayServer(real_bundle, tmp_path / "serve.log", "--replicas", "2", "--max-batch", "4", "--model-name", "m")
    try:
        answers = {srv.client.chat.completions.create(model="m", messages=messages, max_tokens=32,
                                                      temperature=0).choices[0].message.content for _ in range(4)}
    finally:
        assert srv.stop() == 0
    with load(real_bundle, threads=1, max_batch=4, draft=None) as engine:  # a replica's engine: one core, batching
        want = engine.generate(messages=messages, max_new_tokens=32).text
    assert answers == {want}


def test_autoscaling_adds_a_replica_under_load(tiny_bundle, tmp_path):
    srv = RayServer(tiny_bundle, tmp_path / "serve.log", "--replicas", "1", "--max-replicas", "2",
                    "--target-ongoing", "1", "--cpus-per-replica", "1", "--max-batch", "2", replicas=1)
    try:
        assert len(_replica_pids()) == 1
        stop = time.monotonic() + 120

        def load_loop() -> None:  # three clients in a row: three requests in flight against a target of one
            while time.monotonic() < stop and len(_replica_pids()) < 2:
                srv.client.completions.create(model="bundle", prompt="one two", max_tokens=200, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for f in [pool.submit(load_loop) for _ in range(3)]:
                f.result(timeout=180)
        assert len(_replica_pids()) == 2, srv.log()[-3000:]
        assert srv.wait_ready(120, replicas=2)
    finally:
        assert srv.stop() == 0


def test_a_replica_that_cannot_load_fails_the_deploy_in_one_sentence(tiny_bundle, tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine can run the ort-cuda backend")
    before = _ray_pids()
    proc = subprocess.run([sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(tiny_bundle), "--ray",
                           "--replicas", "1", "--backend", "ort-cuda", "--port", str(_free_port())],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: The Ray Serve deployment failed: ONNX Runtime's CUDAExecutionProvider is not "
                           "available"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_ray_pids() - before):
        time.sleep(0.5)
    assert not (_ray_pids() - before)


def test_ray_options_without_ray_or_out_of_order_are_one_sentence(tiny_bundle):
    from click.testing import CliRunner
    from specdeploy.exporter.cli import main

    res = CliRunner().invoke(main, ["serve", str(tiny_bundle), "--replicas", "3", "--ray-address", "auto"])
    assert res.exit_code == 2 and "Error: Without --ray, --replicas, --ray-address cannot be used." in res.output
    res = CliRunner().invoke(main, ["serve", str(tiny_bundle), "--ray", "--replicas", "3", "--max-replicas", "2"])
    assert res.exit_code == 2 and "Error: --max-replicas (2) is below --replicas (3)." in res.output
    res = CliRunner().invoke(main, ["serve", "/nonexistent/bundle", "--ray"])
    assert res.exit_code == 1 and res.output.startswith("Error: ") and res.output.count("\n") == 1
