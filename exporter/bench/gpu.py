"""The GPU check's measurements (``scripts/gpu_check.sh``), designed for a device that no model can reach.

Step times depend on shapes, not weight values, so the real SmolLM2-135M architecture runs with random
weights generated on the device from its shape (:data:`SMOLLM2_135M`): nothing but this repository has
to travel. Stages, each saved to the JSON before the next one starts (a hang or a crash keeps the rest);
a stage that fails records why, the stages built on it are skipped, and the exit code is 1:

0. ``clock`` (GPU only): matrix products for a few seconds, so that no timed stage meets an idle clock,
   then the device-to-device copy bandwidth the roofline divides by;
1. ``steps``: eager against CUDA-graph step time at T = 1, 16 and 64 (CUDA events, the median of 5
   repeats), per precision, with a roofline column and the attention kernels one eager step launches;
2. ``decode``: plain against prompt-lookup speculative decoding, tok/s, tau, the step plan the exactness
   probe chose and every candidate's verdict. Where no plan is exact, speculation runs on the fastest
   plan labelled lossy (``--allow-inexact``); on an exact plan an output that leaves plain decoding fails
   the stage. Random weights repeat themselves, so their tau is not the real model's;
3. ``drafts``: Chimera and the hybrid over it, in torch on the device, on the same plan;
4. ``identity``: greedy tokens of fp16/bf16 against fp32 (TF32 off), per prompt the first divergence and
   the fp32 logit margin there;
5. ``predicted``: end-to-end tok/s for each draft as tau measured on the CPU with the real weights (a
   ``specdeploy bench`` JSON; fp32 tau does not depend on the hardware) over this device's step cost.

``--dry-run``: the same stages and schema on CPU torch with a tiny shape (CI). No transformers here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specdeploy.exporter.bench.gpu_common import (
    Report,
    lossless_problems,
    outputs_equal,
    plan_verdicts,
    sig4,
    timed_decode,
)
from specdeploy.exporter.reference.torch_backend import DTYPES, TorchBackend
from specdeploy.exporter.reference.torch_drafters import random_chimera
from specdeploy.graphs.chimera import ChimeraConfig
from specdeploy.graphs.native_step import StepShape, random_weights
from specdeploy.runtime.architectures import ARCHITECTURES
from specdeploy.runtime.bundle import (
    BundleManifest,
    GraphEntry,
    Limits,
    ModelConfig,
    SourceInfo,
    TokenizerInfo,
)
from specdeploy.runtime.capture import chain_feed
from specdeploy.runtime.drafters import PromptLookupDrafter, kinds
from specdeploy.runtime.drafters.hybrid import HybridDrafter
from specdeploy.runtime.errors import BackendUnavailableError, SpecDeployError
from specdeploy.runtime.plan import StepPlan
from specdeploy.runtime.plan_choice import choose, probe_depth
from specdeploy.runtime.probe import resolve_plan

WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "graphs" / "weights"  # the shipped drafts (tracked)


def _draft_config(path: Path) -> ChimeraConfig:
    """The shape (and taps) of the Chimera draft at ``path``."""
    from specdeploy.exporter.train.weights import load_draft_weights

    return load_draft_weights(path, kinds.CHIMERA).config


SMOLLM2_135M = StepShape(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_positions=8192)
TINY = StepShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rms_norm_eps=1e-5, max_positions=1024)
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s of HBM, by device name
STEP_SIZES = (1, 16, 64)
SEED = 0


def synthetic_manifest(shape: StepShape, max_context: int, max_tree: int,
                       feature_layers: tuple[int, ...] = ()) -> BundleManifest:
    """A manifest for ``shape`` with random weights: what the Decoder and the exactness probe read
    (``feature_layers``: the taps the base step returns, which a fusing Chimera reads)."""
    llama = ARCHITECTURES[0]  # the SmolLM2 shape's family
    model = ModelConfig(llama.name, llama.model_type, shape.vocab_size, shape.hidden_size, shape.num_layers,
                        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.max_positions, eos_token_ids=())
    tag = f"random-seed{SEED}-{shape.num_layers}x{shape.hidden_size}"
    graph = GraphEntry("base", tag, tag, (), (), (), 0, target="ort", precision="fp32",
                       feature_layers=tuple(feature_layers))
    return BundleManifest(model, (graph,), Limits(max_batch=1, max_tree=max_tree, max_context=max_context),
                          TokenizerInfo("none", None, None, None), SourceInfo(tag, "random", tag), ())


def prompts(shape: StepShape, count: int, length: int) -> list[list[int]]:
    """Prompt token ids: random ids with repeated spans, as real prompts (code, lists) have."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(count):
        base = rng.integers(0, shape.vocab_size, size=length // 2).tolist()
        out.append((base + base[: length - len(base)])[:length])
    return out


def roofline_ms(shape: StepShape, dtype_bytes: int, t: int, past: int, bandwidth: float) -> float:
    """The least time a T-row step takes on a bandwidth-bound device: every weight read once (the
    embedding only at T rows) plus the K/V of ``past + t`` slots, at ``bandwidth`` bytes/s."""
    s = shape
    per_layer = s.hidden_size * ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim + 2 * s.intermediate_size) \
        + s.num_heads * s.head_dim * s.hidden_size + s.intermediate_size * s.hidden_size + 2 * s.hidden_size
    weights = s.num_layers * per_layer + s.vocab_size * s.hidden_size + (t + 1) * s.hidden_size
    kv = 2 * s.num_layers * s.num_kv_heads * s.head_dim * (past + t)
    return (weights + kv) * dtype_bytes / bandwidth * 1e3


class Check:
    """The state the stages share: device, shape, manifest, and one backend per (precision, graphs)."""

    def __init__(self, shape: StepShape, device: str, max_context: int, max_tree: int,
                 feature_layers: tuple[int, ...] = ()):
        self.shape, self.device, self.feature_layers = shape, device, tuple(feature_layers)
        self.manifest = synthetic_manifest(shape, max_context, max_tree, self.feature_layers)
        self.cuda = device.startswith("cuda")
        self._weights: dict[str, torch.Tensor] | None = None

    def backend(self, precision: str, graphs: bool) -> TorchBackend:
        if self._weights is None:
            self._weights = random_weights(self.shape, seed=SEED, device=self.device)
        return TorchBackend("", self.manifest, device=self.device, precision=precision, cuda_graphs=graphs,
                            weights=self._weights, shape=self.shape, feature_layers=self.feature_layers)

    def drafters(self, precision: str) -> Iterator[tuple[str, Any]]:
        """(name, drafter) for each model draft, in torch on the device: the shipped Chimera over the random
        base (real shape), or a random one of the tiny shape in a dry run; and the hybrid over it."""
        weights = self._weights
        embed, lm = weights["embed_tokens"], weights["lm_head_t"].t()
        dtype = DTYPES[precision]
        if self.shape == SMOLLM2_135M:  # the base is random here, so only the draft's cost is measured: a
            # draft of the shipped one's shape, reading the last hidden state (the torch backend has no taps)
            cfg = _draft_config(WEIGHTS_DIR / "chimera.safetensors")
            model = random_chimera(dataclasses.replace(cfg, feature_layers=()), embed, lm, self.device, dtype)
        else:
            s = self.shape
            cfg = ChimeraConfig(kinds.CHIMERA, 4, s.hidden_size, s.vocab_size, s.num_heads, s.num_kv_heads,
                                s.head_dim, s.intermediate_size, s.rms_norm_eps, s.rope_theta)
            model = random_chimera(cfg, embed, lm, self.device, dtype)
        yield kinds.CHIMERA, model  # the decoder resets a drafter at each generation, so the hybrid reuses it
        yield kinds.HYBRID, HybridDrafter(model)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step_ms(self, backend: TorchBackend, t: int, past: int, iters: int, repeats: int = 1) -> float:
        """Time of a T-row chain step after ``past`` committed slots (CUDA events on a GPU): the median over
        ``repeats`` runs of the mean of ``iters`` steps."""
        cache = backend.new_cache(1, backend.cap_buckets[0])
        cache.ensure_capacity(past + t, backend.cap_buckets)
        cache.length = past
        feed = chain_feed(np.zeros(t, np.int64), past, cache.capacity, np.arange(t))
        for _ in range(3):
            backend.step(feed, cache)  # warm-up; the step is idempotent
        self.sync()
        runs = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    backend.step(feed, cache)
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    backend.step(feed, cache)
                runs.append((time.perf_counter() - t0) / iters * 1e3)
        return float(np.median(runs))

    def attention_kernels(self, precision: str) -> list[str]:
        """The device kernels one eager 16-row step launches for attention (softmax, flash, fmha, sdpa)."""
        if not self.cuda:
            return []
        with self.backend(precision, False) as backend:
            cache = backend.new_cache(1, backend.cap_buckets[0])
            cache.ensure_capacity(48, backend.cap_buckets)
            cache.length = 16
            feed = chain_feed(np.zeros(16, np.int64), 16, cache.capacity, np.arange(16))
            backend.step(feed, cache)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
                backend.step(feed, cache)
                torch.cuda.synchronize()
        keys = ("attn", "attention", "fmha", "flash", "softmax", "sdpa")
        return sorted({e.name[:160] for e in prof.events() if any(k in e.name.lower() for k in keys)})


def warm_clock(seconds: float) -> dict[str, Any]:
    """Matrix products for ``seconds`` so that the first timed stage does not meet an idle clock, then the
    device-to-device copy bandwidth (bytes read and written per second) the roofline uses."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    torch.cuda.synchronize()
    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t1 = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        torch.cuda.synchronize()
        runs.append(2 * x.numel() * 5 / (time.perf_counter() - t1))
    del a, x, y
    torch.cuda.empty_cache()
    return {"matmuls": n, "seconds": round(time.perf_counter() - t0, 2), "copy_bytes_per_s": float(np.median(runs))}


def draft_call_ms(drafter, shape: StepShape, prompt: list[int], iters: int) -> float:
    """Mean time of one draft call: catch up over ``prompt``, then steps that each accepted one draft."""
    rng = np.random.default_rng(SEED)
    drafter.reset()
    tokens = np.asarray(prompt, np.int64)
    drafter.head_topk(tokens, rng.normal(size=(len(tokens) - 1, shape.hidden_size)).astype(np.float32))
    calls, t0 = drafter.calls, time.perf_counter()
    for _ in range(iters):
        tokens = np.append(tokens, rng.integers(0, shape.vocab_size, size=2))
        drafter.head_topk(tokens, rng.normal(size=(2, shape.hidden_size)).astype(np.float32))
    return (time.perf_counter() - t0) / (drafter.calls - calls) * 1e3


def first_divergence(check: Check, ref: list[int], other: list[int], prompt: list[int]) -> dict[str, Any] | None:
    """Where ``other`` leaves ``ref`` (fp32), and the fp32 top-1 minus top-2 logit margin at that step."""
    i = next((j for j, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b), None)
    if i is None:
        return None
    with check.backend("fp32", False) as fp32:
        seq = np.asarray(prompt + ref[:i], np.int64)
        cache = fp32.new_cache(1, fp32.cap_buckets[-1])
        row = np.asarray(fp32.step(chain_feed(seq, 0, cache.capacity, np.arange(len(seq) - 1, len(seq))),
                                   cache).logits)[0, -1]
    top2 = np.sort(row)[-2:]
    return {"token": i, "fp32": int(ref[i]), "other": int(other[i]), "margin": float(top2[1] - top2[0])}


def run(out: Path, dry_run: bool, cpu_results: Path | None, max_new: int, num_prompts: int) -> Report:
    if not dry_run and not torch.cuda.is_available():
        raise BackendUnavailableError("The GPU check needs a CUDA GPU and PyTorch sees none; pass --dry-run to run "
                                      "its stages on the CPU.")
    cuda = torch.cuda.is_available() and not dry_run
    device = "cuda" if cuda else "cpu"
    shape = TINY if dry_run else SMOLLM2_135M
    name = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    nominal = next((bw for key, bw in BANDWIDTH.items() if key in name), BANDWIDTH["H200"])
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the identity reference
        torch.backends.cudnn.allow_tf32 = False
    check = Check(shape, device, max_context=1024 if not dry_run else 256, max_tree=64)
    rep = Report(out, {"dry_run": dry_run, "device": device, "device_name": name, "torch": torch.__version__,
                       "shape": dataclasses.asdict(shape),
                       "weights": f"random, seed {SEED} (step times depend on shapes, not values)",
                       "bandwidth_bytes_per_s": nominal, "bandwidth_from": "nominal (datasheet)"})
    if cuda:  # a warm clock before the first timed stage, and the bandwidth the roofline divides by
        with rep.stage("clock") as res:
            res.update(warm_clock(3.0))
            rep.data["bandwidth_bytes_per_s"] = res["copy_bytes_per_s"]
            rep.data["bandwidth_from"] = "measured device-to-device copy (clock stage)"
    bandwidth = rep.data["bandwidth_bytes_per_s"]
    precisions = ("fp32", "fp16", "bf16") if cuda else ("fp32",)
    graph_modes = (False, True) if cuda else (False,)
    iters, past = (20, 256) if cuda else (2, 32)
    with rep.stage("steps") as res:
        for prec in precisions:
            size = 4 if prec == "fp32" else 2
            for graphs in graph_modes:
                with check.backend(prec, graphs) as backend:
                    t0 = time.time()
                    captured = backend.capture_all()
                    for t in STEP_SIZES:  # one untimed pass: lazy initialisation, allocator growth
                        check.step_ms(backend, t, past, 2)
                    key = f"{prec}-{'graphs' if graphs else 'eager'}"
                    res[key] = {"captured": captured, "capture_s": round(time.time() - t0, 2), "repeats": 5,
                                "ms": {str(t): sig4(check.step_ms(backend, t, past, iters, repeats=5))
                                       for t in STEP_SIZES}}
                rep.save()
            res[f"{prec}-roofline"] = {"ms": {str(t): sig4(roofline_ms(shape, size, t, past, bandwidth))
                                              for t in STEP_SIZES}}
            res[f"{prec}-attention-kernels"] = check.attention_kernels(prec)
            if cuda:
                e, g = res[f"{prec}-eager"]["ms"], res[f"{prec}-graphs"]["ms"]
                res[f"{prec}-graph-speedup"] = {t: round(e[t] / g[t], 2) for t in e}
    ids = prompts(shape, num_prompts, 64 if not dry_run else 24)
    plain: dict[str, list[list[int]]] = {}
    res_plain: dict[str, float] = {}
    plans: dict[str, StepPlan] = {}
    depth = probe_depth(check.manifest.limits.max_tree)
    problems: list[str] = []
    with rep.stage("decode") as res:
        for prec in precisions:
            with check.backend(prec, cuda) as backend:
                backend.capture_all()
                plan = resolve_plan(backend, check.manifest, use_cache=False)
                # no exact plan: speculation still measured, on the fastest plan, labelled lossy
                spec_plan = plan if plan.speculate else choose(list(plan.probes), depth, allow_inexact=True)
                fastest = dataclasses.replace(spec_plan, candidate=plan.probes[0].candidate, speculate=False)
                ar = timed_decode(check.manifest, backend, plan, None, ids, max_new)
                ar_fast = ar if fastest.candidate == plan.candidate else timed_decode(check.manifest, backend, fastest,
                                                                                      None, ids, max_new)
                pl = timed_decode(check.manifest, backend, spec_plan, PromptLookupDrafter(), ids, max_new)
            plain[prec], res_plain[prec], plans[prec] = ar["tokens"], ar["tok_s"], spec_plan
            same = outputs_equal(ar["tokens"], pl["tokens"])
            res[prec] = entry = {
                "plan": plan.reason, "speculation_plan": spec_plan.reason, "verdicts": plan_verdicts(plan),
                "ar_tok_s": ar["tok_s"], "prompt_lookup_tok_s": pl["tok_s"],
                "speedup": round(pl["tok_s"] / ar["tok_s"], 2) if ar["tok_s"] else None,
                "fastest_plain_plan": fastest.candidate.name, "ar_fastest_plain_tok_s": ar_fast["tok_s"],
                "speedup_vs_fastest_plain": round(pl["tok_s"] / ar_fast["tok_s"], 2) if ar_fast["tok_s"] else None,
                "plan_plain_identical_to_fastest_plain": outputs_equal(ar["tokens"], ar_fast["tokens"]),
                "tau_random_weights": pl["tau"], "speculative_identical_to_plain": same}
            rep.save()
            problems += lossless_problems(entry, spec_plan, same, f"{prec} prompt lookup")
        if problems:  # raised once every precision has been measured
            raise AssertionError("; ".join(problems))
    # the drafts need each precision's plan, which a lossless violation in the decode stage still leaves
    if len(plans) == len(precisions) or rep.ready("drafts", ("decode",)):
        problems = []
        with rep.stage("drafts") as res:  # model drafts in torch on the device: their cost, what tau multiplies
            for prec in precisions:
                with check.backend(prec, cuda) as backend:
                    backend.capture_all()
                    for name, drafter in check.drafters(prec):
                        run = timed_decode(check.manifest, backend, plans[prec], drafter, ids, max_new)
                        same = outputs_equal(plain[prec], run["tokens"])
                        entry = res.setdefault(prec, {})[name] = {
                            "tok_s": run["tok_s"], "vs_plain": round(run["tok_s"] / res_plain[prec], 2),
                            "plan": run["plan"], "tau_random_weights": run["tau"], "identical_to_plain": same}
                        if name == kinds.CHIMERA:  # the draft's own cost, whatever the plan
                            entry["draft_call_ms"] = sig4(draft_call_ms(drafter, check.shape, ids[0], iters))
                        rep.save()
                        problems += lossless_problems(entry, plans[prec], same, f"{prec} {name}")
            if problems:
                raise AssertionError("; ".join(problems))
    if len(plain) == len(precisions) or rep.ready("identity", ("decode",)):
        with rep.stage("identity") as res:
            for prec in precisions[1:]:
                res[prec] = [first_divergence(check, ref, other, p) for ref, other, p in
                             zip(plain["fp32"], plain[prec], ids, strict=True)]
            res["fp32_reference"] = "torch fp32, TF32 off" if cuda else "torch fp32 on the CPU"
    if rep.ready("predicted", ("steps",)):
        with rep.stage("predicted") as res:
            res.update(predict(rep.data.get("steps", {}), rep.data.get("drafts", {}), precisions, cpu_results))
    return rep


def predict(steps: dict[str, Any], drafts: dict[str, Any], precisions: tuple[str, ...],
            cpu_results: Path | None) -> dict[str, Any]:
    """Speed-up over plain decoding per draft: tau (CPU, real weights) x t1 / (t16 + draft), where t1 and t16
    are this device's 1-row and 16-row step times and the draft cost is one draft call per step (a lower
    bound: an adaptive chain makes 1 to 4), measured here in torch for Chimera and the hybrid over it
    (``drafts`` stage), else the CPU's ONNX Runtime figure (``draft_ms_from``)."""
    if cpu_results is None or not cpu_results.is_file():
        return {"skipped": f"no CPU bench JSON at {cpu_results}"}
    runs = json.loads(cpu_results.read_text())
    out: dict[str, Any] = {"cpu_results": str(cpu_results), "cpu": runs.get("config", {}).get("machine"),
                           "assumed_tree_nodes": 16}
    for prec in precisions:
        mode = steps.get(f"{prec}-graphs") or steps.get(f"{prec}-eager")
        if not mode:
            continue
        t1, t16 = mode["ms"]["1"], mode["ms"]["16"]
        here = drafts.get(prec, {})
        out[prec] = {}
        for v in runs.get("variants", []):
            if v.get("skipped") or not v.get("identical_to_ar"):
                continue
            name, tau = v["name"], v["mean_accepted_tokens"]
            device_ms = (here.get(kinds.CHIMERA) or {}).get("draft_call_ms") if name in (kinds.CHIMERA, kinds.HYBRID) else None
            draft_ms = device_ms if device_ms is not None else (v.get("profile") or {}).get("draft_call_ms") or 0.0
            step = t1 if name == "ar" else t16
            out[prec][name] = {"tau_cpu": round(tau, 3), "draft_ms": draft_ms,
                               "draft_ms_from": "device" if device_ms is not None else "cpu",
                               "speedup_vs_plain": round(tau * t1 / (step + draft_ms), 2)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the JSON to write (rewritten after every stage)")
    ap.add_argument("--dry-run", action="store_true", help="CPU torch, a tiny shape: the same stages and schema")
    ap.add_argument("--cpu-results", type=Path, default=None, help="a specdeploy bench JSON for the prediction")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        rep = run(args.out, args.dry_run, args.cpu_results, args.max_new_tokens, args.num_prompts)
    except SpecDeployError as exc:  # one sentence, no traceback
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if rep.failed:  # each stage's reason is in the JSON's "errors"
        print(f"error: the GPU check's stage(s) {', '.join(rep.failed)} did not pass; {args.out} says why.",
              file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
