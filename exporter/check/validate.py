"""``specdeploy validate``: torch against ONNX Runtime on a prefill, a 1-token step and a tree step.

Built on polygraphy's runner interface and Comparator: one runner per framework, the same feeds to
each, per-output max |delta| plus an argmax check on the logits. Every failure is collected first,
then one typed error lists them all; the command ends with ``PASSED`` or ``FAILED``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from specdeploy.runtime import draft_contract as dc
from specdeploy.runtime.architectures import architecture
from specdeploy.runtime.bundle import BundleManifest, read_manifest
from specdeploy.runtime.contract import (
    HIDDEN_STATES,
    INPUT_NAMES,
    LOGITS,
    parse_feature_layers,
    past_names,
    present_names,
)
from specdeploy.runtime.errors import ValidationFailed
from specdeploy.runtime.plan import StepPlan
from specdeploy.runtime.precision import (
    FP16,
    FP32,
    GGUF,
    INT4,
    INT8,
    Q4_1,
    QUANTIZED,
    QUANTIZED_DRAFT_PRECISIONS,
)

# Weight-quantized graphs are judged by their quality report (quality.py): per case their argmax may
# legitimately differ from fp32, and their deltas are bounded only loosely, to catch a broken graph.
# Measured on SmolLM2-135M (max |delta| over prefill/step/tree): int8 logits 1.75, hidden/KV 1.35;
# int4 logits 16.2, hidden/KV 10.6 (its fp32 weights are dequantized Q4_1, so int4 re-rounds them);
# q4_1 (the same Q4_1 weights, int8 activations) logits 5.9, hidden/KV 5.1 on the prefill case.
LOGITS_ATOL = {FP32: 1e-3, FP16: 5e-2, INT8: 4.0, INT4: 40.0, Q4_1: 15.0, GGUF: 15.0}
STATE_ATOL = {INT8: 5.0, INT4: 30.0, Q4_1: 12.0, GGUF: 12.0}  # hidden_states and present_*; default: 10x the logits atol
# ... or, for the weight-quantized precisions, a relative error ||delta|| / ||reference|| of at most this:
# larger models carry larger activations (Qwen2.5-Coder-1.5B's gguf hidden states differ from torch's by
# 12.3 at most on the prefill, a relative 0.053, at top-1 0.980), where a broken graph is off by ~100%. The
# quality report decides; this only catches a broken graph.
QUANTIZED_REL_L2 = 0.15


@dataclass(frozen=True)
class OutputCheck:
    case: str
    output: str
    max_abs: float
    atol: float
    argmax_agree: bool | None  # only for logits; None where it is reported but not decisive
    argmax_rate: float | None = None  # fraction of logits rows whose argmax matches (logits only)
    rel_l2: float | None = None  # quantized graphs: ||delta|| / ||reference||, which passes the check at <= REL_L2

    @property
    def passed(self) -> bool:
        close = self.max_abs <= self.atol or (self.rel_l2 is not None and self.rel_l2 <= QUANTIZED_REL_L2)
        return close and self.argmax_agree is not False


def _torch_runner(module, output_names: list[str], name: str, example: dict[str, np.ndarray]):
    """A polygraphy runner for a CPU torch module taking the graph's flat inputs."""
    import torch
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for k, v in example.items():
        meta.add(k, v.dtype, tuple(f"{k}_d{i}" for i in range(v.ndim)))  # every dimension dynamic

    class TorchCpuRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix="torch-runner")

        def activate_impl(self):
            pass

        def get_input_metadata_impl(self):
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.time()
            with torch.no_grad():
                outs = module(**{k: torch.from_numpy(np.asarray(v)) for k, v in feed_dict.items()})
            self.inference_time = time.time() - t0
            return OrderedDict((n, o.numpy()) for n, o in zip(output_names, outs))

        def deactivate_impl(self):
            pass

    return TorchCpuRunner()


class _FlatStep:
    """Adapts BaseStep(..., past=list) to keyword inputs named like the graph's."""

    def __init__(self, step):
        self.step = step
        self.past_names = past_names(step.num_layers)

    def __call__(self, **kw):
        return self.step(*(kw[n] for n in INPUT_NAMES), [kw[n] for n in self.past_names])


def base_cases(manifest: BundleManifest, step_fn: Callable, prompt_ids: list[int], capacity: int = 32
               ) -> list[tuple[str, dict[str, np.ndarray]]]:
    """Three feeds: prefill, one-token step, and a branching (non-causal) tree step."""
    import torch

    m = manifest.model
    neg = np.finfo(np.float32).min
    n = len(prompt_ids)
    zeros = [np.zeros((1, m.num_kv_heads, capacity, m.head_dim), np.float32) for _ in range(2 * m.num_layers)]
    names_of_past = past_names(m.num_layers)

    def feed(ids, pos, mask_rows, widx, past):
        t = len(ids)
        mask = np.full((1, 1, t, capacity), neg, np.float32)
        mask[0, 0] = np.where(mask_rows, 0.0, neg)
        d = dict(zip(INPUT_NAMES, (np.asarray(ids, np.int64)[None], np.asarray(pos, np.int64)[None], mask,
                                   np.asarray(widx, np.int64), np.arange(t, dtype=np.int64))))
        d.update(zip(names_of_past, past))
        return d

    vis = np.zeros((n, capacity), bool)
    vis[:, :n] = np.tril(np.ones((n, n), bool))
    prefill = feed(prompt_ids, np.arange(n), vis, np.arange(n), zeros)
    with torch.no_grad():
        outs = step_fn(**{k: torch.from_numpy(v) for k, v in prefill.items()})
    past = [o.numpy().copy() for o in outs[2:]]
    next_tok = int(outs[0][0, -1].argmax())

    one = np.zeros((1, capacity), bool)
    one[0, : n + 1] = True
    single = feed([next_tok], [n], one, [n], past)

    # Tree: root, two children, grandchildren on both branches (rows see past + ancestors only).
    parents = [-1, 0, 0, 1, 1, 2, 3]
    depth = [0, 1, 1, 2, 2, 2, 3]
    t = len(parents)
    tmask = np.zeros((t, capacity), bool)
    tmask[:, :n] = True
    for i in range(t):
        j = i
        while j >= 0:
            tmask[i, n + j] = True
            j = parents[j]
    rng = np.random.default_rng(0)
    tree_ids = [next_tok, *rng.integers(0, m.vocab_size, t - 1).tolist()]
    tree = feed(tree_ids, [n + d for d in depth], tmask, np.arange(n, n + t), past)
    return [("prefill", prefill), ("step", single), ("tree", tree)]


def compare_base(bundle_dir: Path, manifest: BundleManifest, step, prompt_ids: list[int],
                 progress: Callable[[str], None] = print, cases: list | None = None) -> list[OutputCheck]:
    """Every base graph of the bundle against torch on the prefill, step and tree cases.

    Torch runs once; each graph is one ONNX Runtime runner of the same comparison. A graph's checks
    are tagged with its target unless it is the traced ``trt`` graph (``tree[ort]``), and with its
    precision too when it shares the target with an fp32 graph (``tree[ort gguf-q4_1]``)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    G_LOGGER.severity = G_LOGGER.ERROR
    flat = _FlatStep(step)
    out_names = [LOGITS, HIDDEN_STATES, *present_names(step.num_layers)]
    cases = cases or base_cases(manifest, flat, prompt_ids)
    entries = [g for g in manifest.graphs if g.role == "base"]
    runners = [_torch_runner(flat, out_names, "torch", cases[0][1])]
    runners += [OnnxrtRunner(SessionFromOnnx(str(bundle_dir / g.file), providers=["CPUExecutionProvider"]),
                             name=f"onnxruntime-{g.file}") for g in entries]
    files = ", ".join(g.file for g in entries)
    progress(f"running torch and ONNX Runtime ({files}) on prefill, step and tree cases ...")
    results = Comparator.run(runners, data_loader=[f for _, f in cases])
    ref = results[0][1]
    checks: list[OutputCheck] = []
    for i, entry in enumerate(entries, start=1):
        got = results[i][1]
        precision = entry.precision
        atol_logits = LOGITS_ATOL.get(precision, 1e-3)
        tag = "" if entry.target == "trt" else f"[{entry.target}]"
        if sum(g.target == entry.target for g in entries) > 1 and entry.precision != "fp32":
            tag = f"[{entry.target} {entry.precision}]"  # e.g. the GGUF-block graph next to the fp32 one
        for (case, feed), a, b in zip(cases, ref, got):
            valid = int(feed["write_indices"][-1]) + 1  # cache slots past+T; the rest is scratch the mask hides
            for name in ("logits", "hidden_states", "present_key_0", f"present_value_{manifest.model.num_layers - 1}"):
                x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
                if name.startswith("present"):
                    x, y = x[:, :, :valid], y[:, :, :valid]
                delta = float(np.max(np.abs(x - y)))
                same = (x.argmax(-1) == y.argmax(-1)) if name == "logits" else None
                agree = bool(same.all()) if same is not None and precision not in QUANTIZED else None
                rate = float(same.mean()) if same is not None else None
                atol = atol_logits if name == "logits" else STATE_ATOL.get(precision, max(atol_logits, 1e-3) * 10)
                rel = float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)) if precision in QUANTIZED else None
                checks.append(OutputCheck(case + tag, name, delta, atol, agree, rate, rel))
    return checks


def report_step_plans(bundle_dir: Path, manifest: BundleManifest,
                      progress: Callable[[str], None] = print) -> StepPlan:
    """Probe every step plan on this machine, bit for bit (``runtime/probe.py``), and print the verdicts.

    A plan whose chain rows differ from plain rows is refused for speculative greedy decoding; the
    runtime takes the first exact one (or decodes plainly when none is). The verdicts replace this machine's
    cached ones, so the plan printed and returned is the one the runtime then takes.
    Not a pass/fail check: exactness is the installed kernels' property, which the runtime measures
    and acts on at load, not the export's.
    """
    from specdeploy.runtime.backends import make_backend
    from specdeploy.runtime.machine import machine_id
    from specdeploy.runtime.plan import ROWS_CHECK
    from specdeploy.runtime.plan_choice import candidates, probe_depth
    from specdeploy.runtime.probe import probe, resolve_plan
    from specdeploy.runtime.verdicts import store_verdict, verdict_key

    depth = probe_depth(manifest.limits.max_tree)
    progress(f"probing step plans bit for bit on this machine ({machine_id()}), chains of 2..{depth} rows ...")
    with make_backend("ort-cpu", bundle_dir, manifest) as backend:
        results = []
        for cand in candidates(backend, depth):  # afresh, and kept as this machine's verdicts
            results.append(probe(backend, manifest, cand, depth))
            store_verdict(verdict_key(backend, manifest, cand, depth), results[-1])
        plan = resolve_plan(backend, manifest)  # the runtime's choice, from those verdicts
    for r in results:
        worst = r.worst()
        chains = "exact" if r.chains_exact else f"DIFFER ({worst.max_abs:.2g} at {worst.what})"
        tree = max((c for c in r.checks if c.what.startswith("tree")), key=lambda c: c.max_abs, default=None)
        trees = "not probed" if tree is None else "exact" if r.trees_exact else f"differ ({tree.max_abs:.2g})"
        batch = [c for c in r.checks if c.what.startswith(ROWS_CHECK)]
        worst_row = max((c.max_abs for c in batch), default=0.0)
        rows = "" if not batch else "; rows of several sequences " + (
            "exact" if r.rows_exact else f"differ ({worst_row:.2g})")
        progress(f"  plan {r.candidate.name:<18} chains {chains}; trees {trees}{rows}; {r.plain_ms:.1f} ms per plain "
                 "step" + ("" if r.chains_exact else "  -> speculative greedy decoding refused on this plan"))
    progress(f"  runtime: {plan.reason}")
    return plan


def report(checks: list[OutputCheck], out: Callable[[str], None] = print) -> None:
    out(f"{'case':<24}{'output':<20}{'max |delta|':>14}{'atol':>10}  argmax (quantized: relative L2 error)")
    for c in checks:
        if c.argmax_agree is None:
            arg = "-" if c.argmax_rate is None else f"{c.argmax_rate:.0%} same (see quality)"
        else:
            arg = "same" if c.argmax_agree else "DIFFERS"
        flag = "" if c.passed else "   <-- FAIL"
        rel = "" if c.rel_l2 is None else f"  ({c.rel_l2:.1e} <= {QUANTIZED_REL_L2})"
        out(f"{c.case:<24}{c.output:<20}{c.max_abs:>14.3e}{c.atol:>10.0e}  {arg}{rel}{flag}")


def validate_bundle(bundle_dir: str | Path, model: str | None = None,
                    progress: Callable[[str], None] = print) -> list[OutputCheck]:
    """Check the bundle's graphs against torch; raises ValidationFailed listing every failure."""
    from specdeploy.exporter.source import load_model
    from specdeploy.graphs.base_step import BaseStep

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    progress(f"loading the source model ({model or manifest.source.path}) ...")
    loaded = load_model(model or manifest.source.path)
    if loaded.weight_sha != manifest.source.weight_sha:
        raise ValidationFailed(
            "The model given for validation is not the one the bundle was exported from (weight hash differs)."
        )
    desc = architecture(loaded.model.config, where=loaded.path)
    progress(f"architecture: {desc.describe(loaded.model.config)}")
    for entry in manifest.graphs:
        if entry.weight_blocks:
            progress(f"weights ({entry.file}): {weight_blocks_summary(entry.weight_blocks)}")
    if wrong := desc.mismatches(loaded.model):
        raise ValidationFailed(f"The model does not fit the {desc.model_type} description: {'; '.join(wrong)}.")
    step = BaseStep(loaded.model).eval()
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog. Speculative decoding")["input_ids"]
    cases = base_cases(manifest, _FlatStep(step), list(ids)[:16])
    checks = compare_base(bundle_dir, manifest, step, list(ids)[:16], progress, cases)
    if manifest.drafts:
        checks += compare_drafts(bundle_dir, manifest, loaded, list(ids)[:16], progress)
    report(checks, progress)
    report_step_plans(bundle_dir, manifest, progress)
    failed = [f"{c.case}/{c.output} max|delta| {c.max_abs:.2e}" for c in checks if not c.passed]
    failed += quality_failures(bundle_dir, manifest, step, loaded.tokenizer, progress)
    if failed:
        raise ValidationFailed(f"{len(failed)} check(s) failed: {'; '.join(failed)}.")
    return checks


def weight_blocks_summary(held: tuple[tuple[str, str], ...]) -> str:
    """"133 Q5_0, 13 Q8_0 ... kept as the GGUF's blocks; re-quantized: ...", from a graph's ``weight_blocks``."""
    from collections import Counter

    kept = Counter(how for _, how in held if how not in ("fp32",) and not how.startswith("requantized"))
    other = [f"{name} ({how})" for name, how in held if how == "fp32" or how.startswith("requantized")]
    text = ", ".join(f"{n} {kind}" for kind, n in sorted(kept.items())) + " kept as the GGUF's own blocks"
    return text + (f"; not kept: {', '.join(other[:6])}{' ...' if len(other) > 6 else ''}" if other else "")


def quality_failures(bundle_dir: Path, manifest: BundleManifest, step, tokenizer,
                     progress: Callable[[str], None] = print) -> list[str]:
    """For a weight-quantized base graph: print its quality report; return why it fails, if it does."""
    precision = manifest.base_graph("ort").precision
    if precision not in QUANTIZED:
        return []
    from specdeploy.exporter.check.quality import quality_report

    progress(f"measuring {precision} quality against fp32 (teacher-forced, held-in text) ...")
    quality = quality_report(bundle_dir, manifest, step, tokenizer)
    for line in quality.table():
        progress(line)
    if quality.passed:
        return []
    why = (f"quality: top-1 agreement {quality.top1_agreement:.3f} (min {quality.min_top1}), "
           f"perplexity ratio {quality.ppl_ratio:.3f} (max {quality.max_ppl_ratio})")
    return [why]


# --- drafts ----------------------------------------------------------------------------------------
DRAFT_LOGPROB_ATOL = 1e-3
# Quantized draft graphs against the fp32 torch reference: looser bounds that still catch a broken graph
# (the draft's rounding only changes which tokens are proposed; verification keeps the output exact).
DRAFT_ATOL = {FP32: DRAFT_LOGPROB_ATOL, INT8: 0.5, INT4: 2.0}


def compare_drafts(bundle_dir: Path, manifest: BundleManifest, loaded, prompt_ids: list[int],
                   progress: Callable[[str], None] = print) -> list[OutputCheck]:
    """Torch vs ONNX Runtime on every draft graph, fed real base hidden states (and logits) of a prompt, by the
    validate hook each draft kind's description names (:func:`compare_heads`, :func:`compare_chimera`)."""
    import torch
    from specdeploy.runtime.drafters.kinds import known, resolve

    with torch.no_grad():
        out = loaded.model.model(input_ids=torch.tensor([prompt_ids]))
        hidden = out.last_hidden_state  # [1, L, H]
        logits = loaded.model.lm_head(hidden)  # [1, L, V]
    feeds = {HIDDEN_STATES: hidden.numpy().astype(np.float32), LOGITS: logits.numpy().astype(np.float32)}
    checks: list[OutputCheck] = []
    for entry in manifest.drafts:
        kind = known(entry.kind)
        if kind is None or kind.validate is None:
            progress(f"draft '{entry.kind}': no parity check registered here, skipped")
            continue
        checks += resolve(kind.validate)(bundle_dir, entry, loaded, prompt_ids, feeds, progress)
    return checks


def compare_heads(bundle_dir: Path, entry, loaded, prompt_ids: list[int], feeds: dict[str, np.ndarray],
                  progress: Callable[[str], None] = print) -> list[OutputCheck]:
    """A heads draft's graphs. Heads: max |delta| of the top-k log-probs, and the top-1 ids must agree wherever
    the first two candidates are further apart than the tolerance (closer ones may swap). The gate graph:
    entropy and gate probability."""
    import torch
    from specdeploy.exporter.export.draft import torch_draft_modules
    from specdeploy.runtime.backends.ort import make_session
    from specdeploy.runtime.drafters.kinds import describe

    progress(f"running torch and ONNX Runtime on the {entry.kind} draft graphs ...")
    modules = torch_draft_modules(entry, loaded.model.lm_head.weight.detach())
    gate = describe(entry.kind).gate_role
    checks: list[OutputCheck] = []
    for g in entry.graphs:
        # an int8 or int4 graph is checked against the fp32 heads
        module = modules[entry.kind if g.precision in QUANTIZED_DRAFT_PRECISIONS else g.role]
        names = [i.name for i in g.inputs]
        session = make_session(bundle_dir / g.file, "cpu")
        got = session.run(None, {n: feeds[n] for n in names})
        with torch.no_grad():
            ref = [t.numpy() for t in module(*(torch.from_numpy(feeds[n]) for n in names))]
        if gate is None or g.role != gate.role:  # heads, any precision: (topk_ids, topk_logprobs)
            atol = DRAFT_ATOL[g.precision]
            delta = float(np.max(np.abs(ref[1] - got[1])))
            gap = ref[1][..., 0] - ref[1][..., 1]  # [B, N, K]
            clear = gap > atol * 10
            agree = bool((ref[0][..., 0] == got[0][..., 0])[clear].all())
            checks.append(OutputCheck(g.role, dc.TOPK_LOGPROBS, delta, atol, agree))
        else:
            for name, a, b in zip([o.name for o in g.outputs], ref, got):
                checks.append(OutputCheck(g.role, name, float(np.max(np.abs(a - b))), DRAFT_LOGPROB_ATOL, None))
    return checks


def compare_chimera(bundle_dir: Path, entry, loaded, prompt_ids: list[int], feeds: dict[str, np.ndarray],
                    progress: Callable[[str], None] = print) -> list[OutputCheck]:
    """One catch-up step over the prompt's real base states (head 2 on the last row), torch vs ORT."""
    import torch
    from specdeploy.exporter.export.draft import torch_draft_modules
    from specdeploy.graphs.chimera import trigram_ids
    from specdeploy.runtime.backends.ort import make_session
    from specdeploy.runtime.drafters.kinds import describe

    progress(f"running torch and ONNX Runtime on the {entry.kind} draft step ...")
    hidden = feeds[HIDDEN_STATES]
    module = torch_draft_modules(entry, loaded.model.lm_head.weight.detach(), loaded.model.model.embed_tokens.weight
                                 .detach())[describe(entry.kind).role(dc.CHIMERA_STEP).role]
    n = len(prompt_ids) - 1  # slots 0..n-1; slot j's trigram ends at token j+1
    cap = n + 4
    mask = np.full((1, 1, n, cap), np.finfo(np.float32).min, dtype=np.float32)
    mask[0, 0, :, :n] = np.where(np.tril(np.ones((n, n), dtype=bool)), 0.0, mask[0, 0, :, :n])
    kv = (1, int(entry.setting("num_kv_heads")), cap, int(entry.setting("head_dim")))
    rng = np.random.default_rng(0)
    feeds = {
        dc.HIDDEN: hidden[:, :n].astype(np.float32),
        dc.TRIGRAM_IDS: np.asarray([trigram_ids(prompt_ids, range(n))], dtype=np.int64),
        dc.POSITION_IDS: np.arange(n, dtype=np.int64)[None],
        dc.ATTENTION_MASK: mask,
        dc.WRITE_INDICES: np.arange(n, dtype=np.int64),
        dc.BASE_HIDDEN: hidden[:, n - 1].astype(np.float32),
        dc.HEAD_INDEX: np.array([min(1, int(entry.setting("num_heads")) - 1)], dtype=np.int64),
        dc.PAST_KEY: rng.standard_normal(kv).astype(np.float32),
        dc.PAST_VALUE: rng.standard_normal(kv).astype(np.float32),
    }
    taps = parse_feature_layers(entry.setting("feature_layers"))
    if taps:  # a fusing draft's real slots read the tapped layers' states
        with torch.no_grad():
            states = loaded.model.model(input_ids=torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states
        feeds[dc.LAYER_STATES] = torch.cat([states[i + 1][:, :n] for i in taps], dim=-1).numpy().astype(np.float32)
        feeds[dc.FROM_LAYERS] = np.ones(1, dtype=np.float32)
    checks = []
    ref = None
    for graph in entry.graphs:
        session = make_session(bundle_dir / graph.file, "cpu")
        names = [i.name for i in graph.inputs]
        got = session.run(None, {k: feeds[k] for k in names})
        if ref is None:
            with torch.no_grad():
                ref = [t.numpy() for t in module(*(torch.from_numpy(feeds[k].copy()) for k in names))]
        atol = DRAFT_ATOL[graph.precision]
        out_names = [o.name for o in graph.outputs]
        for name, a, b in zip(out_names, ref, got):
            if name == dc.TOPK_IDS:
                continue
            agree = None
            if name == dc.TOPK_LOGPROBS:
                gap = a[..., 0] - a[..., 1]
                clear = gap > atol * 10
                ids_ref, ids_got = ref[out_names.index(dc.TOPK_IDS)], got[out_names.index(dc.TOPK_IDS)]
                agree = bool((ids_ref[..., 0] == ids_got[..., 0])[clear].all())
            checks.append(OutputCheck(graph.role, name, float(np.max(np.abs(a - b))), atol, agree))
    return checks
