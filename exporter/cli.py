"""The ``specdeploy`` command line.

User errors (``SpecDeployError``) print as one line without a traceback; anything else is a bug and
keeps its traceback. ``generate`` and ``serve`` import only the lean runtime (no torch); commands
that trace or train import torch lazily.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from specdeploy.runtime.errors import SpecDeployError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BACKEND_CHOICE = click.Choice(["ort-cpu", "ort-cuda", "ort-trt", "trt", "torch"])


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecDeployError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(130)


@click.group(cls=_Group)
@click.version_option(package_name="specdeploy")
def main() -> None:
    """specdeploy: export LLMs with their drafts to ONNX/TensorRT and decode them fast and losslessly."""


# --- export ----------------------------------------------------------------------------------
@main.group()
def export() -> None:
    """Export the base model or a draft into a bundle."""


@export.command("base")
@click.option("--model", "model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M).")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Bundle directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option("--max-context", type=int, default=None, help="Maximum prompt + generated tokens.")
@click.option("--max-tree", type=int, default=64, show_default=True, help="Maximum tree nodes per step.")
def export_base_cmd(model: str | None, out: Path, force: bool, max_context: int | None, max_tree: int) -> None:
    """Trace the base decoder step (tree attention, in-place KV) to ONNX.

    \b
    Example:
      specdeploy export base --out bundles/smollm2
    """
    from .export import export_base

    export_base(model, out, force=force, max_context=max_context, max_tree=max_tree)
    click.echo(f"Wrote bundle {out}")


# --- validate --------------------------------------------------------------------------------
@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--model", default=None, help="Source model, if it moved since export.")
def validate(bundle: Path, model: str | None) -> None:
    """Compare torch with ONNX Runtime on prefill, step and tree cases; ends with PASSED or FAILED."""
    from specdeploy.runtime.errors import ValidationFailed

    from .validate import validate_bundle

    try:
        validate_bundle(bundle, model, progress=click.echo)
    except ValidationFailed as exc:
        click.echo(f"FAILED: {exc}")
        sys.exit(1)
    click.echo("PASSED")


# --- generate --------------------------------------------------------------------------------
@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--draft", default="none", show_default=True, help="none, prompt-lookup, or a draft kind in the bundle.")
@click.option("--tree", default=None, help="Tree name (tree8/16/32/64, chain4...) or JSON choices; default auto.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--typical", is_flag=True, help="LOSSY: Medusa typical acceptance instead of exact rejection sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--backend", default="ort-cpu", show_default=True, type=BACKEND_CHOICE)
@click.option("--threads", default=None, type=int, help="Intra-op threads (default: all cores).")
def generate(bundle: Path, prompt: str, chat: bool, max_new_tokens: int, draft: str, tree: str | None,
             temperature: float, top_p: float, top_k: int, seed: int | None, typical: bool, stop: tuple[str, ...],
             backend: str, threads: int | None) -> None:
    """Stream a completion and finish with tokens/s.

    \b
    Example:
      specdeploy generate bundles/smollm2 --chat --prompt "Name three prime numbers." --draft prompt-lookup
    """
    from specdeploy.runtime import load

    with load(bundle, backend=backend, draft=draft, threads=threads, tree=tree) as engine:
        stream = engine.stream(prompt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, seed=seed, stop=stop, typical=typical)
        for delta in stream:
            click.echo(delta, nl=False)
        click.echo()
        st = stream.completion.stats
        lossy = "  [LOSSY typical acceptance]" if st.lossy else ""
        click.echo(
            f"-- {st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s end-to-end, "
            f"{st.decode_tokens_per_s:.1f} tok/s decode, tau {st.mean_accepted:.2f}, "
            f"finish: {stream.completion.finish_reason}{lossy}",
            err=True,
        )


# --- bench -----------------------------------------------------------------------------------
@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--variants", default="ar,hf", show_default=True, help="Comma-separated variant names.")
@click.option("--prompts", "prompts_file", default=None, type=click.Path(path_type=Path),
              help="JSONL of {'prompt': ...} or MT-bench records (default: MT-bench question.jsonl).")
@click.option("--num-prompts", default=20, show_default=True, type=int)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--threads", default=2, show_default=True, type=int)
@click.option("--tree", default=None, help="Tree for speculative variants (default auto).")
@click.option("--json", "json_out", default=Path("bench.json"), show_default=True, type=click.Path(path_type=Path))
def bench(bundle: Path, variants: str, prompts_file: Path | None, num_prompts: int, max_new_tokens: int,
          threads: int, tree: str | None, json_out: Path) -> None:
    """Side-by-side benchmark; every variant runs in its own process, interleaved per prompt.

    Writes JSON (--json), a Markdown table and a PNG plot next to it.

    \b
    Example:
      specdeploy bench bundles/smollm2 --variants ar,hf,prompt-lookup --num-prompts 20 --json out/bench.json
    """
    from .bench import run_bench

    t0 = time.time()
    run_bench(bundle, [v.strip() for v in variants.split(",") if v.strip()], prompts_file, num_prompts,
              max_new_tokens, threads, tree, json_out)
    click.echo(f"bench finished in {time.time() - t0:.0f}s; wrote {json_out}")


if __name__ == "__main__":
    main()
