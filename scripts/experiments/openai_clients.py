"""Concurrent OpenAI-client requests against `specdeploy serve`, one server per --max-batch setting.

    python scripts/experiments/openai_clients.py BUNDLE [--max-batch 1,32] [--clients 32] [--max-tokens 128]

For each setting it starts `specdeploy serve` on loopback (draft prompt-lookup, 2 threads), asks each of the
first --clients MT-bench first turns alone (greedy, one after another), then all of them at once from as
many threads with the `openai` package's client, and prints the aggregate completion tok/s and how many
concurrent answers equal the same prompt's answer alone. `specdeploy bench-serve` measures the same with
a lean HTTP client; this one adds the OpenAI client's own work (it shares the machine's cores).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def _serve(bundle: Path, port: int, max_batch: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdeploy.exporter.cli", "serve", str(bundle), "--port", str(port),
           "--max-batch", str(max_batch), "--draft", "prompt-lookup", "--threads", "2"]
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return srv
        except OSError:
            if srv.poll() is not None:
                raise SystemExit(f"the server exited; see {log}") from None
            time.sleep(0.5)
    srv.terminate()
    raise SystemExit(f"the server did not start; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--max-batch", default="1,32", help="comma-separated settings, one server each")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8761)
    args = ap.parse_args()

    try:
        from openai import OpenAI
    except ImportError:
        raise SystemExit("This script needs the openai package: pip install openai") from None
    from specdeploy.exporter.bench.run import default_prompts_file, read_prompt_records

    prompts = [p for p, _ in read_prompt_records(default_prompts_file())[: args.clients]]
    rates = {}
    for i, mb in enumerate(int(x) for x in args.max_batch.split(",")):
        log = Path(f"openai_clients_serve_{mb}.log")
        srv = _serve(args.bundle, args.port + i, mb, log)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{args.port + i}/v1", api_key="-", max_retries=0, timeout=900)
            model = client.models.list().data[0].id

            def ask(prompt: str, client=client, model=model):
                return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=args.max_tokens, temperature=0)

            alone = [ask(p).choices[0].message.content for p in prompts]
            out: dict[int, object] = {}
            threads = [threading.Thread(target=lambda k=k, out=out: out.__setitem__(k, ask(prompts[k])))
                       for k in range(len(prompts))]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            srv.terminate()
            srv.wait(60)
        tokens = sum(r.usage.completion_tokens for r in out.values())
        same = sum(out[k].choices[0].message.content == alone[k] for k in range(len(prompts)))
        rates[mb] = tokens / wall
        ratio = f", {rates[mb] / next(iter(rates.values())):.2f}x the first" if i else ""
        print(f"--max-batch {mb}: {len(prompts)} OpenAI clients, {tokens} tokens in {wall:.2f} s = {rates[mb]:.1f} "
              f"tok/s{ratio}; identical to alone {same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
