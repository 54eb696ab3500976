"""Serving tests' helpers: a `specdeploy serve` subprocess on a free loopback port, and SSE parsing."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

PROMPTS = [f"Story {i}: once upon a time in the city of {c}" for i, c in
           enumerate(["Paris", "Lagos", "Lima", "Oslo", "Hanoi", "Quito", "Perth", "Cairo"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `specdeploy serve` subprocess; its log goes to a file the tests can read."""

    def __init__(self, bundle: Path, log_path: Path, *args: str):
        self.log_path = log_path
        for _ in range(3):  # the free port can be taken between the probe and the bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(bundle), "--port", str(self.port),
                     *args], stdout=log, stderr=subprocess.STDOUT)
            if self._wait_healthy(120):
                return
            if "address already in use" not in self.log().lower():
                break
        self.proc.kill()
        pytest.fail(f"server did not start:\n{self.log()}")

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, as a process manager would; the server must exit on its own, without hanging."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"server still running {timeout}s after SIGTERM:\n{self.log()[-3000:]}")


def sse_text(lines: list[str]) -> tuple[str, list[dict], bool]:
    """Concatenated text, the parsed events, and whether [DONE] came."""
    text, events, done = "", [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        ev = json.loads(line[6:])
        events.append(ev)
        for ch in ev.get("choices", []):
            text += ch["delta"].get("content") or "" if "delta" in ch else ch["text"]
    return text, events, done


def long_stream(url: str, model: str, prompt: str, started: threading.Event) -> tuple[str, list[dict], bool]:
    """A streamed 480-token completion read to its end; ``started`` is set at its first line."""
    payload = {"model": model, "prompt": prompt, "max_tokens": 480, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            started.set()
            lines.append(line)
    return sse_text(lines)


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


# --- serve --ray -------------------------------------------------------------------------------------
RAY_KEY = "ray-test-key"


def ray_pids() -> set[int]:
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


def replica_pids() -> list[int]:
    pids = []
    for pid in ray_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ServeReplica" in cmd and "engine" in cmd:
            pids.append(pid)
    return sorted(pids)


class RayServer:
    """One `specdeploy serve --ray` subprocess with ``replicas`` replicas, and an openai client for it."""

    def __init__(self, bundle: Path, log_path: Path, *args: str, replicas: int = 2):
        self.before = ray_pids()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(bundle), "--ray", "--port",
                 str(self.port), "--api-key", RAY_KEY, *args], stdout=log, stderr=subprocess.STDOUT)
        if not self.wait_ready(240, replicas=replicas):
            self.proc.kill()
            pytest.fail(f"ray server did not start:\n{self.log()[-4000:]}")
        import openai

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=RAY_KEY, max_retries=0, timeout=120)

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
            if healthy and len(replica_pids()) >= replicas:
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
