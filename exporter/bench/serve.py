"""``specdeploy bench-serve``: a real ``specdeploy serve`` on loopback under concurrent clients.

For each ``--max-batch`` setting (``N`` or ``N:DRAFT``, a draft of its own) one server process runs (its own
ONNX Runtime threads; this process only sends requests). All of them start before any is timed, and they take
turns, so that a drift of the machine's speed falls on every server alike. At concurrency 1 every prompt is asked
once, one after another, of every server in turn: that gives the single-client speed and, for each prompt, its answer
alone on that server. At each higher concurrency
``c``, ``c`` clients draw the prompts from one queue, each sending its next request as soon as its last one is
answered (greedy, ``max_tokens`` each), until every prompt was asked; with fewer prompts than clients the prompts are
asked again in turn, so that all ``c`` clients start at once.
Measured: aggregate completion tokens per second of wall time, p50 and p95 request latency, and
whether each answer is complete (the token budget or the end of the turn) and identical to the same
prompt's answer alone on that server and on the first server (list ``1:none`` first to hold every answer to the
bundle's plain greedy answer). A structured prompt set's requests carry their ``response_format`` or ``tools`` and
``tool_choice``; every answer is then also checked to meet it (JSON valid against the schema, or tool calls of a
known tool with valid arguments), and tool-call answers are compared by their calls' names and arguments.
Written as JSON with a PNG of throughput and latency.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdeploy.exporter.bench.report import machine_info
from specdeploy.exporter.bench.run import BenchError
from specdeploy.exporter.bench.structured import Constraint, call_signature, check_answer

STARTUP_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class _Server:
    """``specdeploy serve`` in a child process, on a free loopback port."""

    def __init__(self, bundle: Path, max_batch: int, draft: str, threads: int, log: Path,
                 suffix_cache_tokens: int | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        argv = [sys.executable, "-c", "from specdeploy.exporter.cli import main; main()", "serve", str(bundle),
                "--port", str(self.port), "--max-batch", str(max_batch), "--draft", draft, "--threads", str(threads),
                "--max-queue", "256", "--model-name", "bench"]
        if suffix_cache_tokens is not None:
            argv += ["--suffix-cache-tokens", str(suffix_cache_tokens)]
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"The server (--max-batch {max_batch}) exited while starting: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise BenchError(f"The server (--max-batch {max_batch}) did not become healthy in {STARTUP_TIMEOUT_S:.0f} s.")
            time.sleep(0.5)

    def tail(self, lines: int = 8) -> str:
        self._log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def chat(self, prompt: str, max_tokens: int, constraint: Constraint | None = None) -> dict:
        """One greedy chat request (with the prompt's constraint); the answer, its latency and, where the request
        had a constraint, ``invalid``: why the answer does not meet it (None: it does)."""
        t0 = time.perf_counter()
        body = _post(self.url + "/v1/chat/completions", {
            "model": "bench", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}], **(constraint.keywords() if constraint else {})}, 3600)
        choice = body["choices"][0]
        text, calls = choice["message"].get("content") or "", choice["message"].get("tool_calls") or None
        out = {"latency_s": time.perf_counter() - t0, "text": text, "tool_calls": calls,
               # what must match another server's answer: the calls' names and arguments (their ids differ), else the text
               "answer": json.dumps(call_signature(calls)) if calls else text,
               "finish_reason": choice["finish_reason"], "tokens": body["usage"]["completion_tokens"]}
        if constraint is not None:
            out["invalid"] = check_answer(constraint, text, calls)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _concurrent(server: _Server, prompts: list[str], clients: int, max_tokens: int,
                constraints: dict[str, Constraint]) -> tuple[list[dict], float]:
    """``clients`` client threads, started at once, each asking the next of ``prompts`` until none is left; the
    answers (in the prompts' order) and the wall time."""
    out: list[dict | BaseException | None] = [None] * len(prompts)
    gate = threading.Barrier(clients + 1)
    queue = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        gate.wait()
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                out[i] = server.chat(prompts[i], max_tokens, constraints.get(prompts[i]))
            except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                out[i] = exc

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [o for o in out if not isinstance(o, dict)]
    if failed:
        raise BenchError(f"{len(failed)} of {len(prompts)} requests failed ({failed[0]}); server log: {server.tail()}")
    return [o for o in out if isinstance(o, dict)], wall


def _by_category(answers: list[dict], prompts: list[str], categories: dict[str, str]) -> dict[str, dict]:
    """Per prompt category: requests, and completion tokens per second of request time (each request's own)."""
    out: dict[str, dict] = {}
    for a, p in zip(answers, prompts):
        c = out.setdefault(categories.get(p, "all"), {"requests": 0, "tokens": 0, "latency_s": 0.0})
        c["requests"] += 1
        c["tokens"] += a["tokens"]
        c["latency_s"] += a["latency_s"]
    return {k: {"requests": v["requests"], "tokens_per_s_per_request": round(v["tokens"] / v["latency_s"], 2)}
            for k, v in out.items()}


def _summary(answers: list[dict], wall: float, alone: dict[str, dict], prompts: list[str], max_tokens: int,
             clients: int, categories: dict[str, str] | None = None) -> dict:
    tokens = sum(a["tokens"] for a in answers)
    lat = [a["latency_s"] for a in answers]
    complete = sum(a["finish_reason"] in ("stop", "tool_calls") or (a["finish_reason"] == "length"
                                                                     and a["tokens"] == max_tokens) for a in answers)
    same = sum(a["answer"] == alone[p]["answer"] for a, p in zip(answers, prompts))
    checked = [a["invalid"] for a in answers if "invalid" in a]
    return {"clients": clients, "requests": len(answers), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "p50_latency_s": round(_percentile(lat, 0.5), 3),
            "p95_latency_s": round(_percentile(lat, 0.95), 3), "complete": complete, "identical_to_alone": same,
            **({"constrained": len(checked), "valid": sum(why is None for why in checked),
                "invalid_examples": [why for why in checked if why is not None][:3]} if checked else {}),
            **({"categories": _by_category(answers, prompts, categories)} if categories else {})}


def run_serve_bench(bundle: Path, max_batches: list[int | tuple[int, str]], concurrency: list[int], prompts: list[str],
                    max_new_tokens: int, threads: int, draft: str, json_out: Path,
                    say: Callable[[str], None] = print, categories: dict[str, str] | None = None,
                    constraints: dict[str, Constraint] | None = None, suffix_cache_tokens: int | None = None,
                    repeats: int = 1) -> dict[str, Any]:
    """``max_batches``: one server each, a max_batch or (max_batch, draft) (else ``draft``); ``categories``: each
    prompt's category (a named prompt set), reported apart in every run; ``constraints``: a prompt's constraint,
    sent with it and checked in its answers; ``suffix_cache_tokens``: every server's suffix cache (None: its
    default; 0: off); ``repeats``: how many times each server runs each concurrency above 1, the servers taking
    turns (A B B A ...), pooled, each repeat's tok/s kept (``repeat_tokens_per_s``)."""
    constraints = constraints or {}
    if not prompts:
        raise BenchError("bench-serve needs at least one prompt.")
    servers = [mb if isinstance(mb, tuple) else (mb, draft) for mb in max_batches]
    levels = sorted(set(concurrency))
    if not levels or levels[0] < 1 or not servers or min(mb for mb, _ in servers) < 1 or repeats < 1:
        raise BenchError("--concurrency, --max-batch and --repeats take whole numbers of at least 1.")
    uniq = list(dict.fromkeys(prompts))
    report: dict[str, Any] = {
        "command": "bench-serve", "bundle": str(bundle), "draft": draft, "threads": threads,
        "max_new_tokens": max_new_tokens, "concurrency": levels, "prompts": len(uniq),
        "suffix_cache_tokens": suffix_cache_tokens, "repeats": repeats,
        "machine": machine_info(), "servers": []}
    logs = Path(tempfile.mkdtemp(prefix="specdeploy-bench-serve-"))
    running: list[_Server] = []
    try:
        for i, (mb, srv_draft) in enumerate(servers):
            say(f"starting server --max-batch {mb} --draft {srv_draft} ...")
            running.append(_Server(bundle, mb, srv_draft, threads, logs / f"serve-{i}-{mb}.log", suffix_cache_tokens))
            running[-1].chat(uniq[0], 8, constraints.get(uniq[0]))  # warm-up: first allocations, the tokenizer
        # Every server is up before any is timed, and they take turns, so that a drift of the machine's speed
        # (seen on shared VMs: 10-20% within minutes) falls on all of them alike: at concurrency 1 each prompt is
        # asked of every server in turn, the order reversed every other prompt; at each higher concurrency the
        # servers run one after another, the order reversed every other level and every other repeat, so that a
        # steady drift cancels out of the ratios over an even number of repeats.
        say(f"  concurrency 1: {len(uniq)} prompts one after another, each asked of every server in turn "
            "(each prompt's answer alone) ...")
        alone: list[dict[str, dict]] = [{} for _ in servers]
        walls = [0.0] * len(servers)
        for j, p in enumerate(uniq):
            for k in _turns(len(servers), j):
                t0 = time.perf_counter()
                alone[k][p] = running[k].chat(p, max_new_tokens, constraints.get(p))
                walls[k] += time.perf_counter() - t0
        runs = []
        for k in range(len(servers)):
            first = _summary([alone[k][p] for p in uniq], walls[k], alone[k], uniq, max_new_tokens, 1, categories)
            runs.append([{**first, "repeat_tokens_per_s": [first["tokens_per_s"]],
                          "_texts": [(p, alone[k][p]["answer"]) for p in uniq]}])
        for li, c in enumerate(c for c in levels if c > 1):
            asked = [uniq[i % len(uniq)] for i in range(max(c, len(uniq)))]
            answered: list[list[dict]] = [[] for _ in servers]  # every repeat's answers, in turn
            seconds, rates = [0.0] * len(servers), [[] for _ in servers]  # wall time in all; each repeat's tok/s
            for rep in range(repeats):
                for k in _turns(len(servers), li * repeats + rep):
                    (mb, srv_draft), server = servers[k], running[k]
                    say(f"  concurrency {c}: {len(asked)} requests to --max-batch {mb} --draft {srv_draft}"
                        + (f" (repeat {rep + 1} of {repeats})" if repeats > 1 else "") + " ...")
                    answers, wall = _concurrent(server, asked, c, max_new_tokens, constraints)
                    answered[k] += answers
                    seconds[k] += wall
                    r = _summary(answers, wall, alone[k], asked, max_new_tokens, c, categories)
                    rates[k].append(r["tokens_per_s"])
                    n = r["requests"]
                    say(f"    {r['tokens_per_s']:.1f} tok/s, p50 {r['p50_latency_s']:.2f} s, p95 {r['p95_latency_s']:.2f} s, "
                        f"identical {r['identical_to_alone']}/{n}, complete {r['complete']}/{n}"
                        + (f", valid {r['valid']}/{r['constrained']}" if "valid" in r else ""))
            for k in range(len(servers)):
                runs[k].append({**_summary(answered[k], seconds[k], alone[k], asked * repeats, max_new_tokens, c,
                                           categories), "repeat_tokens_per_s": rates[k],
                                "_texts": [(p, a["answer"]) for p, a in zip(asked * repeats, answered[k])]})
        for k, (mb, srv_draft) in enumerate(servers):
            report["servers"].append({"max_batch": mb, "draft": srv_draft,
                                      "runs": sorted(runs[k], key=lambda r: r["clients"]),
                                      "answers_alone": {p: alone[k][p]["answer"] for p in uniq}})
    finally:
        for server in running:
            server.close()
    _compare(report)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_out.with_name(json_out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, json_out)
    _plot(report, json_out.with_suffix(".png"))
    return report


def _turns(count: int, turn: int) -> list[int]:
    """The servers' order on ``turn``: as listed, reversed every other turn."""
    order = list(range(count))
    return order if turn % 2 == 0 else order[::-1]


def _compare(report: dict) -> None:
    """Each server against the first (``--max-batch`` as listed first): speed ratios and identical answers."""
    first = report["servers"][0]
    by_c = {r["clients"]: r for r in first["runs"]}
    for srv in report["servers"]:
        for r in srv["runs"]:  # every answer against the same prompt's answer alone on the first server
            r["identical_to_first"] = sum(text == first["answers_alone"].get(p) for p, text in r.pop("_texts"))
    for srv in report["servers"][1:]:
        for r in srv["runs"]:
            ref = by_c.get(r["clients"])
            if ref:
                r["vs_first"] = {"tokens_per_s": round(r["tokens_per_s"] / ref["tokens_per_s"], 3),
                                 "p95_latency": round(r["p95_latency_s"] / ref["p95_latency_s"], 3),
                                 # repeat i against the first server's repeat i, run next to it
                                 "repeat_tokens_per_s": [round(a / b, 3) for a, b in zip(r["repeat_tokens_per_s"],
                                                                                          ref["repeat_tokens_per_s"])]}
        srv["alone_identical_to_first"] = sum(a == first["answers_alone"].get(p)
                                              for p, a in srv["answers_alone"].items())


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for srv in report["servers"]:
        cs = [r["clients"] for r in srv["runs"]]
        ax1.plot(cs, [r["tokens_per_s"] for r in srv["runs"]], marker="o", label=f"--max-batch {srv['max_batch']} --draft {srv['draft']}")
        ax2.plot(cs, [r["p95_latency_s"] for r in srv["runs"]], marker="o", label=f"--max-batch {srv['max_batch']} --draft {srv['draft']}")
    for ax, title in ((ax1, "aggregate completion tok/s"), (ax2, "p95 request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    m = report["machine"]
    fig.suptitle(f"specdeploy serve, {report['max_new_tokens']} tokens, "
                 f"{report['threads']} threads ({m['cpu_model']}; {m['cpu_isa']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
