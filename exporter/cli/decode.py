"""The decoding commands of the ``specdeploy`` CLI: ``generate``, ``bench`` and ``serve``.

``generate`` and ``serve`` import only the lean runtime (no torch). The ``specdeploy`` group
(:mod:`specdeploy.exporter.cli`) adds these commands to itself; their shared options are in :mod:`.options`.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
from specdeploy.exporter.bench.promptsets import SETS
from specdeploy.exporter.cli.options import decode_options
from specdeploy.runtime.drafters.kinds import AUTO

DEFAULT_SERVE_BATCH = 32  # measured: docs/benchmarks.md, "Serving many users"


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@decode_options
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--typical", is_flag=True, help="LOSSY: Medusa typical acceptance instead of exact rejection sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
def generate(bundle: Path, prompt: str, chat: bool, max_new_tokens: int, draft: str, tree: str | None,
             temperature: float, top_p: float, top_k: int, seed: int | None, typical: bool, stop: tuple[str, ...],
             backend: str, threads: int | None, allow_inexact: bool, step_plan: str | None) -> None:
    """Stream a completion and finish with tokens/s.

    \b
    Example:
      specdeploy generate bundles/smollm2 --chat --prompt "Name three prime numbers." --draft prompt-lookup
    """
    with load_engine(bundle, backend=backend, draft=draft, threads=threads, tree=tree,
                     allow_inexact=allow_inexact, step_plan=step_plan) as engine:
        stream = engine.stream(prompt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, seed=seed, stop=stop, typical=typical)
        for delta in stream:
            click.echo(delta, nl=False)
        click.echo()
        st = stream.completion.stats
        lossy = ""
        if st.lossy:
            lossy = "  [LOSSY typical acceptance]" if typical else "  [LOSSY: inexact speculation, --allow-inexact]"
        click.echo(
            f"-- {st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s end-to-end, "
            f"{st.decode_tokens_per_s:.1f} tok/s decode, tau {st.mean_accepted:.2f}, "
            f"finish: {stream.completion.finish_reason}{lossy}",
            err=True,
        )


def load_engine(bundle: Path, **options):
    """``runtime.load`` for a command: the step plan's one line on stderr (and its warning, if any)."""
    import warnings

    from specdeploy.runtime import load
    from specdeploy.runtime.errors import ExactnessWarning

    say = lambda msg: click.echo(f"[plan] {msg}", err=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExactnessWarning)
        engine = load(bundle, progress=say, **options)
    refused = [w for w in caught if issubclass(w.category, ExactnessWarning)]
    for w in caught:
        if w not in refused:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for w in refused:  # the refusal carries the plan's reason
        click.echo(f"warning: {w.message}", err=True)
    if not refused:
        say(engine.plan.reason)
    if engine.max_batch > 1:
        say(engine.batch_reason)
    return engine


# --- bench -----------------------------------------------------------------------------------
@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--variants", default="ar,hf", show_default=True,
              help="Comma-separated variant names (ar, prompt-lookup, hf, hf-prompt-lookup, ...).")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(path_type=Path),
              help="JSONL of {'prompt': ...} or MT-bench records (default: MT-bench question.jsonl).")
@click.option("--prompt-set", default=None, type=click.Choice(SETS),
              help="A named prompt set instead of --prompts: Spec-Bench's categories from public data in PyPI packages "
                   "(spec-bench, structured: --num-prompts of each); json-extraction, tool-calls and json-template "
                   "decode under their JSON schema or tools, and each answer is checked; see docs/benchmarks.md.")
@click.option("--num-prompts", default=20, show_default=True, type=int)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--threads", default=2, show_default=True, type=int)
@click.option("--tree", default=None, help="Tree for speculative variants (default auto).")
@click.option("--json", "json_out", default=Path("bench.json"), show_default=True, type=click.Path(path_type=Path))
@click.option("--emulate-cpu", default=None, metavar="QEMU_CPU",
              help="Run our variants under QEMU emulating this CPU model (e.g. EPYC-Rome: AVX2 only) to see the "
                   "step plan and identity there; tok/s are then the emulator's. Needs qemu-user.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="Run each prompt this many times per variant, each time in a worker of its own that saw the same "
                   "requests before it, interleaved; each prompt counts its median run (steadier category ratios).")
def bench(bundle: Path, variants: str, prompts_file: Path | None, prompt_set: str | None, num_prompts: int,
          max_new_tokens: int, threads: int, tree: str | None, json_out: Path, emulate_cpu: str | None,
          repeats: int) -> None:
    """Side-by-side benchmark; every variant runs in its own process, interleaved per prompt.

    Variants: ar (our plain autoregressive ORT decoding, always run as the baseline of the speed-up
    and identity columns), auto, suffix, prompt-lookup, ngram, chimera, hybrid, cerberus, medusa (drafts or
    tables stored in the bundle), hf (transformers generate, greedy fp32) and hf-prompt-lookup; on the
    exact-tree step plan (--step-plan gathered) ar-gathered, prompt-lookup-gathered, chimera-gathered,
    medusa-gathered and cerberus-nogate-gathered; the peers llama.cpp, llama.cpp-lookup, ort-genai-int4,
    ort-genai-int4-ngram, ort-genai-fp32, ort-genai-fp32-ngram (a speculative variant of another plain
    decoding brings that one, and says on how many prompts it kept its output).
    Every variant's quality class (top-1 agreement and perplexity against fp32, teacher-forced on held-in
    text) is measured after the timing. A variant whose package or draft is missing is skipped with a note.
    Prompts are rendered with the chat template; all variants decode the same token ids greedily, and each
    prompt category is also reported on its own, and where auto runs beside single draft sources, auto against
    the fastest of them by category. --repeats N runs each prompt N times per variant (N workers of each).

    Writes JSON (--json), a Markdown table (same stem, .md, also printed), a tokens/s plot
    (<stem>.png) and acceptance histograms (<stem>_acceptance.png).

    \b
    Example:
      specdeploy bench bundles/smollm2 --variants ar,hf,prompt-lookup --num-prompts 20 --json out/bench.json
      specdeploy bench bundles/smollm2-q4_1 --variants auto,ngram,llama.cpp-lookup --prompt-set spec-bench --num-prompts 8
      specdeploy bench bundles/smollm2-q4_1 --variants ar,auto,llama.cpp --prompt-set structured --num-prompts 8
      specdeploy bench bundles/smollm2-q4_1 --variants ar,ngram --num-prompts 4 --max-new-tokens 32 --emulate-cpu EPYC-Rome
    """
    from specdeploy.exporter.bench.run import run_bench

    t0 = time.time()
    run_bench(bundle, [v.strip() for v in variants.split(",") if v.strip()], prompts_file, num_prompts,
              max_new_tokens, threads, tree, json_out, emulate_cpu=emulate_cpu, prompt_set=prompt_set, repeats=repeats)
    click.echo(f"bench finished in {time.time() - t0:.0f}s; wrote {json_out}")


# --- serve -----------------------------------------------------------------------------------
@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@decode_options
@click.option("--api-key", default=None, envvar="SPECDEPLOY_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (or set SPECDEPLOY_API_KEY).")
@click.option("--model-name", default=None, help="Model id on /v1/models (default: the bundle folder's name).")
@click.option("--max-prompt-tokens", default=None, type=click.IntRange(min=1),
              help="Longest prompt accepted, in tokens (default: the bundle's context - 1).")
@click.option("--max-tokens-limit", default=None, type=click.IntRange(min=1),
              help="Largest max_tokens a request may ask for (default: the bundle's context).")
@click.option("--max-body-bytes", default=1_000_000, show_default=True, type=click.IntRange(min=1),
              help="Larger request bodies get a 413.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=1),
              help="Generation requests admitted at once (running + queued); more get a 503.")
@click.option("--shutdown-timeout", default=10.0, show_default=True, type=float,
              help="Seconds in-flight requests get to finish on SIGTERM/SIGINT before they are cancelled.")
@click.option("--suffix-cache-tokens", default=None, type=click.IntRange(min=0),
              help="With --draft suffix or auto: output tokens the suffix cache shared across requests holds "
                   "(default 16384; 0: off).")
@click.option("--cache-per-user", is_flag=True,
              help="With --draft suffix or auto: keep the shared suffix cache apart per request 'user' field.")
@click.option("--max-batch", default=None, type=click.IntRange(min=1),
              help=f"Requests decoded together in every step (continuous batching on the bundle's exact-tree graph, "
                   f"with any draft). 1: one at a time, on the bundle's fastest graph. Default: "
                   f"{DEFAULT_SERVE_BATCH} where the bundle, backend and draft allow batching, else 1.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Serve --replicas engines as one Ray Serve deployment (needs: pip install 'specdeploy[ray]').")
@click.option("--replicas", default=None, type=click.IntRange(min=1), help="With --ray: replicas (default 2).")
@click.option("--max-replicas", default=None, type=click.IntRange(min=1),
              help="With --ray: autoscale between --replicas and this many, by requests in flight per replica.")
@click.option("--target-ongoing", default=None, type=click.IntRange(min=1),
              help="With --ray and --max-replicas: requests in flight per replica to scale at (default: --max-batch).")
@click.option("--cpus-per-replica", default=None, type=click.IntRange(min=1),
              help="With --ray: cores each replica is pinned to, and its threads (default: this machine's cores "
                   "shared by the replicas).")
@click.option("--ray-address", default=None,
              help="With --ray: a running Ray cluster to deploy on ('auto', or ray://HOST:10001); default: start "
                   "a local Ray that stops with this command.")
def serve(bundle: Path, host: str, port: int, draft: str, tree: str | None, backend: str, threads: int | None,
          api_key: str | None, model_name: str | None, max_prompt_tokens: int | None, max_tokens_limit: int | None,
          max_body_bytes: int, max_queue: int, shutdown_timeout: float, allow_inexact: bool, step_plan: str | None,
          suffix_cache_tokens: int | None, cache_per_user: bool, max_batch: int | None, use_ray: bool, replicas: int | None, max_replicas: int | None,
          target_ongoing: int | None,
          cpus_per_replica: int | None, ray_address: str | None) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (needs: pip install 'specdeploy[serve]').

    Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true),
    GET /v1/models, GET /health, GET /metrics (Prometheus). Up to --max-batch requests decode together;
    more queue in arrival order.

    \b
    Example:
      specdeploy serve bundles/smollm2 --draft prompt-lookup --port 8000
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
    """
    from specdeploy.runtime.server import ServerConfig
    from specdeploy.runtime.server_run import run_server

    ray_options = {"--replicas": replicas, "--max-replicas": max_replicas, "--target-ongoing": target_ongoing,
                   "--cpus-per-replica": cpus_per_replica, "--ray-address": ray_address}
    if not use_ray and any(v is not None for v in ray_options.values()):
        given = ", ".join(k for k, v in ray_options.items() if v is not None)
        raise click.UsageError(f"Without --ray, {given} cannot be used.")
    replicas = replicas or 2
    if max_replicas is not None and max_replicas < replicas:
        raise click.UsageError(f"--max-replicas ({max_replicas}) is below --replicas ({replicas}).")

    max_batch = DEFAULT_SERVE_BATCH if max_batch is None else max_batch
    config = ServerConfig(host=host, port=port, model_name=model_name, api_key=api_key,
                          max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit,
                          max_body_bytes=max_body_bytes, max_queue=max_queue, shutdown_timeout=shutdown_timeout,
                          cache_per_user=cache_per_user)
    if use_ray:
        _serve_ray(bundle, config, {"backend": backend, "draft": draft, "threads": threads, "tree": tree,
                                    "allow_inexact": allow_inexact, "step_plan": step_plan, "max_batch": max_batch,
                                    "suffix_cache_tokens": suffix_cache_tokens},
                   replicas, max_replicas, target_ongoing, cpus_per_replica, ray_address)
        return
    with load_engine(bundle, backend=backend, draft=draft, threads=threads, tree=tree,
                     allow_inexact=allow_inexact, step_plan=step_plan, max_batch=max_batch,
                     suffix_cache_tokens=suffix_cache_tokens) as engine:
        run_server(engine, config)


def _serve_ray(bundle: Path, config, load: dict, replicas: int, max_replicas: int | None, target_ongoing: int | None,
               cpus_per_replica: int | None, address: str | None) -> None:
    """``serve --ray``: the same server in every replica of a Ray Serve deployment."""
    import os

    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.ray_serve import RayConfig, ReplicaSpec, run_ray

    read_manifest(bundle)  # a wrong path or a corrupt bundle: one sentence before Ray starts
    top = max_replicas or replicas
    cpus = cpus_per_replica or max(1, len(os.sched_getaffinity(0)) // top)
    ray_config = RayConfig(replicas=replicas, max_replicas=max_replicas,
                           target_ongoing=target_ongoing or load["max_batch"], cpus_per_replica=cpus, address=address)
    # Every node opens the bundle at this absolute path (docs/ray.md).
    spec = ReplicaSpec(bundle=str(bundle.expanduser().resolve()), load=load, server=config, cpus=cpus)
    run_ray(spec, ray_config, say=lambda m: click.echo(m, err=True))


# --- bench-serve -----------------------------------------------------------------------------
@click.command("bench-serve")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--max-batch", "max_batches", default=f"1:none,1,{DEFAULT_SERVE_BATCH}", show_default=True,
              help="Comma-separated servers, each N (its --max-batch, with --draft) or N:DRAFT; one server each, "
                   "compared with the first (speed, and every answer against its answer alone there).")
@click.option("--concurrency", default="1,4,16,32", show_default=True, help="Comma-separated client counts.")
@click.option("--draft", default=AUTO, show_default=True,
              help="The servers' draft where --max-batch names none: any draft `serve` takes.")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(path_type=Path),
              help="JSONL prompts ({'prompt': ...} or MT-bench 'turns'); default: MT-bench first turns.")
@click.option("--prompt-set", default=None, type=click.Choice(SETS),
              help="A named prompt set instead of --prompts (--num-prompts of each category for spec-bench and "
                   "structured); each category is reported apart. Second turns are left out: a server request carries "
                   "no earlier answer. The structured sets send their response_format or tools, and every answer is "
                   "checked to meet it.")
@click.option("--num-prompts", default=16, show_default=True, type=click.IntRange(min=1),
              help="Prompts asked (the first of --prompts; of each category of --prompt-set). Every concurrency asks "
                   "each of them, the clients drawing them from one queue (again in turn where clients outnumber them).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--suffix-cache-tokens", default=None, type=click.IntRange(min=0),
              help="Every server's --suffix-cache-tokens. Each concurrency asks the same prompts again, so the suffix "
                   "cache of a drafting server holds their answers from the first; 0 measures text never seen.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="Runs of each concurrency above 1 per server, the servers taking turns (A B B A ...); pooled, "
                   "with each repeat's ratio to the first server shown, so that a drift of the machine's speed shows.")
@click.option("--json", "json_out", default=Path("bench-serve.json"), show_default=True, type=click.Path(path_type=Path),
              help="Results; a PNG of throughput and latency goes beside it.")
def bench_serve(bundle: Path, max_batches: str, concurrency: str, draft: str, prompts_file: Path | None,
                prompt_set: str | None, num_prompts: int, max_new_tokens: int, threads: int,
                suffix_cache_tokens: int | None, repeats: int, json_out: Path) -> None:
    """Measure `specdeploy serve` under concurrent clients on loopback: aggregate tok/s, p50/p95 latency.

    \b
    Example:
      specdeploy bench-serve bundles/smollm2 --max-batch 1,16 --concurrency 1,4,16,32 --max-new-tokens 128
      specdeploy bench-serve bundles/smollm2 --max-batch 1:none,4 --concurrency 1,4 --prompt-set structured --num-prompts 4
    """
    from specdeploy.exporter.bench.run import BenchError, default_prompts_file, read_prompt_records
    from specdeploy.exporter.bench.serve import run_serve_bench
    from specdeploy.runtime.bundle import read_manifest

    read_manifest(bundle)  # a wrong path or a corrupt bundle: one sentence before any server starts

    def ints(text: str, what: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise BenchError(f"{what} takes comma-separated whole numbers; got '{text}'.") from None

    def servers(text: str) -> list[tuple[int, str]]:
        out = []
        for item in (x.strip() for x in text.split(",") if x.strip()):
            mb, _, name = item.partition(":")
            out.append((ints(mb, "--max-batch")[0] if mb.strip() else 0, name.strip() or draft))
        return out

    categories, constraints = None, None
    if prompt_set is not None:
        if prompts_file is not None:
            raise BenchError("Give --prompts or --prompt-set, not both.")
        from specdeploy.exporter.bench.promptsets import load_set

        items = [it for it in load_set(prompt_set, num_prompts) if not it.earlier_turns]
        if not items:
            raise BenchError(f"The '{prompt_set}' set holds second turns only, which bench-serve cannot send.")
        prompts, categories = [it.text for it in items], {it.text: it.category for it in items}
        constraints = {it.text: c for it in items if (c := it.constraint) is not None}
    else:  # a file's records may name their category
        records = read_prompt_records(prompts_file or default_prompts_file())
        records = records[:num_prompts]
        prompts = [text for text, _ in records]
        categories = {text: c for text, c in records if c} if prompts_file is not None else None
    report = run_serve_bench(bundle, servers(max_batches), ints(concurrency, "--concurrency"), prompts,
                             max_new_tokens, threads, draft, json_out, say=click.echo, categories=categories,
                             constraints=constraints, suffix_cache_tokens=suffix_cache_tokens, repeats=repeats)
    m = report["machine"]
    click.echo(f"machine: {m['cpu_model']} ({m['cpu_isa']}), {threads} threads")
    for srv in report["servers"]:
        for r in srv["runs"]:
            vs = r.get("vs_first")
            spread = vs["repeat_tokens_per_s"] if vs else []
            extra = (f"  ({vs['tokens_per_s']:.2f}x tok/s" + (f" [{min(spread):.2f}-{max(spread):.2f}x over {len(spread)} "
                     "repeats]" if len(spread) > 1 else "") + f", {vs['p95_latency']:.2f}x p95 of the first)") if vs else ""
            click.echo(f"--max-batch {srv['max_batch']:>3} --draft {srv['draft']:<13} clients {r['clients']:>3}: "
                       f"{r['tokens_per_s']:7.1f} tok/s  p50 {r['p50_latency_s']:6.2f} s  p95 {r['p95_latency_s']:6.2f} s"
                       f"  identical {r['identical_to_alone']}/{r['requests']} (to the first server: "
                       f"{r['identical_to_first']}/{r['requests']})  complete {r['complete']}/{r['requests']}"
                       + (f"  valid {r['valid']}/{r['constrained']}" if "valid" in r else "") + extra)
            for cat, c in (r.get("categories") or {}).items():
                click.echo(f"    {cat:<16} {c['requests']:3d} requests  {c['tokens_per_s_per_request']:7.1f} tok/s per request")
    click.echo(f"wrote {json_out} and {json_out.with_suffix('.png')}")
