"""The bench report's two pictures: tokens/s by variant, and each variant's tokens per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted, or a dash where there is none."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def plot_speed(report: dict[str, Any], path: Path, subject: str) -> None:
    """Tokens/s per variant, each bar labelled with its end-to-end speed-up against ar."""
    import matplotlib.pyplot as plt

    ran = [v for v in report["variants"] if not v["skipped"]]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(ran) + 2), 4))
    bars = ax.bar([v["name"] for v in ran], [v["tokens_per_s"] for v in ran], color="tab:blue")
    for bar, v in zip(bars, ran):
        label = fmt(v["speedup_vs_ar"], ".2f", "×")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    xytext=(0, 2), textcoords="offset points")
    c = report["config"]
    ax.set_ylabel("tokens/s (end to end, mean over prompts)")
    emulated = f"\nEMULATED {c['emulated_cpu']} (QEMU): not a CPU's speed" if c.get("emulated_cpu") else ""
    ax.set_title(f"{subject}: {c['num_prompts']} prompts x {c['max_new_tokens']} tokens, "
                 f"{c['threads']} threads{emulated}", fontsize=9)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance(report: dict[str, Any], path: Path) -> None:
    """Each variant's histogram of tokens emitted per decode step."""
    import matplotlib.pyplot as plt

    ran = [v for v in report["variants"] if not v["skipped"]]
    fig, axes = plt.subplots(1, max(1, len(ran)), figsize=(3.2 * max(1, len(ran)), 3), squeeze=False)
    for ax, v in zip(axes[0], ran):
        hist = v["acceptance_histogram"]
        if hist:
            total = sum(hist.values())
            ax.bar([int(k) for k in hist], [n / total for n in hist.values()], color="tab:green")
            ax.set_xticks([int(k) for k in hist])
        else:
            ax.text(0.5, 0.5, "no per-step data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{v['name']} (τ {fmt(v['mean_accepted_tokens'], '.2f')})", fontsize=9)
        ax.set_xlabel("tokens per step")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("fraction of steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
