"""Quality of a quantized bundle against the fp32 source model: top-1 agreement and perplexity.

Both are teacher-forced on fixed held-in English text (:data:`HELD_IN_TEXTS`): each paragraph goes
through the bundle's base graph in ONNX Runtime as one prefill with logits for every position, and
through the torch fp32 step (``graphs/base_step.BaseStep``) on the same ids.

* top-1 agreement: the fraction of positions where the quantized argmax equals the fp32 argmax
  (this is what greedy decoding follows, so it bounds how long greedy outputs stay identical);
* perplexity: exp of the mean negative log-likelihood of the actual next token, fp32 and quantized.

A report passes when agreement reaches :data:`MIN_TOP1` and the perplexity ratio stays under
:data:`MAX_PPL_RATIO` for the bundle's precision. The thresholds were calibrated on SmolLM2-135M-
Instruct (see the numbers next to them) with a margin for other models of its size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from specdeploy.runtime.bundle import BundleManifest
from specdeploy.runtime.contract import INPUT_NAMES, LOGITS, past_names
from specdeploy.runtime.precision import GGUF, INT4, INT8, Q4_1

# Calibrated on SmolLM2-135M-Instruct (HELD_IN_TEXTS, 394 positions; fp32 perplexity 16.22), with the
# quantize.py defaults: int8 top-1 0.949, perplexity ratio 1.005; int4 top-1 0.690, ratio 1.24. int8 with
# fp32 activations (accuracy_level 0) reaches 0.967 but runs ~16x slower on the CPU, and int4 re-rounds
# weights that are already dequantized Q4_1, so both sit below the textbook 0.97 / 0.85. The limits
# leave room for sampling noise (+-0.02 at 394 positions) and other models of this size, and still
# fail a broken graph (top-1 near 0, perplexity in the hundreds) or a wrong lm_head/layout.
MIN_TOP1 = {INT8: 0.92, INT4: 0.60, Q4_1: 0.85, GGUF: 0.85}
MAX_PPL_RATIO = {INT8: 1.03, INT4: 1.40, Q4_1: 1.03, GGUF: 1.03}

# Held-in text: plain, varied English (narrative, explanation, instructions, dialogue, a list).
HELD_IN_TEXTS = (
    ("The history of the bicycle begins in the early nineteenth century, when inventors in Germany and "
     "France built wooden machines that riders pushed along with their feet. Pedals attached to the front "
     "wheel came decades later, and the chain drive that turns the rear wheel made the modern safety "
     "bicycle possible in the 1880s. Within a few years, cycling clubs had spread across Europe and North "
     "America, and women in particular found in the bicycle a new kind of independence."),
    ("Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
     "into sugar and oxygen. It takes place mostly in the leaves, inside small structures called "
     "chloroplasts, which contain the pigment chlorophyll. The light reactions capture energy and split "
     "water molecules, while the Calvin cycle uses that energy to build glucose from carbon dioxide."),
    ("To make a simple loaf of bread, mix five hundred grams of flour with a teaspoon of salt and a packet "
     "of dried yeast. Add about three hundred millilitres of warm water and knead the dough for ten "
     "minutes until it is smooth and elastic. Leave it in a warm place for an hour, shape it, let it rise "
     "again, and bake it at two hundred degrees for about thirty minutes."),
    ("\"Are you coming to the meeting tomorrow?\" asked Maria. \"I think so,\" said Tom, \"but I still "
     "have to finish the report for the client. If I stay late tonight, I should be able to send it "
     "before nine.\" Maria nodded and reminded him that the budget figures had changed since last week, "
     "so the tables at the end would need to be updated as well."),
    ("There are several good habits for writing clear software. First, give functions and variables names "
     "that say what they mean. Second, keep each function short and focused on one task. Third, write "
     "tests that check the behaviour you care about, and run them often. Finally, ask a colleague to "
     "review your changes, because a second pair of eyes catches mistakes that the author misses."),
)


@dataclass(frozen=True)
class QualityReport:
    """Teacher-forced quality of a bundle's base graph against the fp32 source model."""

    precision: str
    texts: int
    positions: int  # predictions compared (top-1)
    top1_agreement: float
    ppl_fp32: float
    ppl_bundle: float
    min_top1: float
    max_ppl_ratio: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_bundle / self.ppl_fp32

    @property
    def passed(self) -> bool:
        return self.top1_agreement >= self.min_top1 and self.ppl_ratio <= self.max_ppl_ratio

    def table(self) -> list[str]:
        top1_ok = "ok" if self.top1_agreement >= self.min_top1 else "FAIL"
        ppl_ok = "ok" if self.ppl_ratio <= self.max_ppl_ratio else "FAIL"
        top1_limit, ppl_limit = f">= {self.min_top1:.3f}", f"x <= {self.max_ppl_ratio:.3f}"
        ratio = f"ratio {self.ppl_ratio:.4f}"
        return [
            (f"quality ({self.precision} vs torch fp32, teacher-forced on {self.texts} held-in paragraphs, "
             f"{self.positions} positions)"),
            f"  {'metric':<22}{'fp32':>10}{self.precision:>10}{'limit':>12}",
            f"  {'top-1 agreement':<22}{1.0:>10.4f}{self.top1_agreement:>10.4f}{top1_limit:>12}  {top1_ok}",
            f"  {'perplexity':<22}{self.ppl_fp32:>10.3f}{self.ppl_bundle:>10.3f}{ppl_limit:>12}  {ppl_ok} ({ratio})",
        ]


def causal_feed(ids: Sequence[int], manifest: BundleManifest, kv_dtype=np.float32) -> dict[str, np.ndarray]:
    """One prefill over ``ids`` with logits for every position and an empty cache of capacity len(ids)."""
    m = manifest.model
    n = len(ids)
    neg = np.finfo(np.float32).min
    mask = np.where(np.tril(np.ones((n, n), bool)), 0.0, neg).astype(np.float32)[None, None]  # [1, 1, N, N]
    feed = dict(zip(INPUT_NAMES, (np.asarray(ids, np.int64)[None], np.arange(n, dtype=np.int64)[None], mask,
                                  np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64))))
    for name in past_names(m.num_layers):
        feed[name] = np.zeros((1, m.num_kv_heads, n, m.head_dim), kv_dtype)
    return feed


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def nll(logits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """Negative log-likelihood of each next token: logits [N, V] for ids [N] -> [N-1]."""
    lp = _log_softmax(logits[:-1])
    return -lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def ort_logits_fn(bundle_dir: Path, manifest: BundleManifest, threads: int | None = None
                  ) -> Callable[[Sequence[int]], np.ndarray]:
    """Teacher-forced logits [N, V] of the bundle's base graph in ONNX Runtime on the CPU."""
    from specdeploy.runtime.backends.ort import make_session

    entry = manifest.base_graph("ort")
    session = make_session(Path(bundle_dir) / entry.file, "cpu", threads)
    kv = np.dtype(next(s.dtype for s in entry.inputs if s.name == past_names(1)[0]))

    def run(ids: Sequence[int]) -> np.ndarray:
        return session.run([LOGITS], causal_feed(ids, manifest, kv))[0][0]

    return run


def torch_logits_fn(step, manifest: BundleManifest) -> Callable[[Sequence[int]], np.ndarray]:
    """Teacher-forced logits [N, V] of a torch ``BaseStep`` (the fp32 reference)."""
    import torch

    def run(ids: Sequence[int]) -> np.ndarray:
        feed = {k: torch.from_numpy(v) for k, v in causal_feed(ids, manifest).items()}
        with torch.no_grad():
            out = step(*(feed[n] for n in INPUT_NAMES), [feed[n] for n in past_names(step.num_layers)])
        return out[0][0].numpy()

    return run


def measure(ref: Callable[[Sequence[int]], np.ndarray], got: Callable[[Sequence[int]], np.ndarray],
            texts: Sequence[Sequence[int]]) -> tuple[int, float, float, float]:
    """(positions, top-1 agreement, ppl ref, ppl got) over token-id sequences."""
    agree = total = 0
    nll_ref: list[np.ndarray] = []
    nll_got: list[np.ndarray] = []
    for ids in texts:
        a, b = ref(ids), got(ids)  # [N, V] each
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
        nll_ref.append(nll(a, ids))
        nll_got.append(nll(b, ids))
    ppl = (float(np.exp(np.concatenate(nll_ref).mean())), float(np.exp(np.concatenate(nll_got).mean())))
    return total, agree / total, ppl[0], ppl[1]


def quality_report(bundle_dir: Path, manifest: BundleManifest, step, tokenizer,
                   texts: Sequence[str] = HELD_IN_TEXTS, threads: int | None = None) -> QualityReport:
    """Top-1 agreement and perplexity of the bundle's base graph against the torch fp32 ``step``."""
    precision = manifest.base_graph("ort").precision
    ids = [list(tokenizer(t)["input_ids"]) for t in texts]
    ref = torch_logits_fn(step, manifest)
    got = ort_logits_fn(bundle_dir, manifest, threads)
    positions, top1, ppl_ref, ppl_got = measure(ref, got, ids)
    return QualityReport(precision, len(ids), positions, top1, ppl_ref, ppl_got,
                         MIN_TOP1.get(precision, 0.99), MAX_PPL_RATIO.get(precision, 1.01))
