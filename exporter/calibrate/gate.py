"""The Cerberus gate's calibration: entropy or a learned MLP, its threshold swept for measured tokens/s."""

from __future__ import annotations

import time

import numpy as np
from specdeploy.exporter.calibrate.traces import Trace, simulate
from specdeploy.runtime.contract import HIDDEN_STATES, LOGITS


def time_gate(gate_session, traces: list[Trace], vocab: int, repeats: int = 200) -> float:
    rng = np.random.default_rng(0)
    hidden = traces[0].hidden[:1][None].astype(np.float32)
    logits = rng.standard_normal((1, 1, vocab)).astype(np.float32)
    feed = {HIDDEN_STATES: hidden, LOGITS: logits}
    for _ in range(10):
        gate_session.run(None, feed)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gate_session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def train_learned_gate(traces: list[Trace], accepts: list[np.ndarray], hidden_size: int, seed: int = 0):
    """Fit the gate MLP on the first half of the traces, check on the second; returns (module, report)."""
    import torch
    from specdeploy.graphs.gate import GateGraph

    half = max(1, len(traces) // 2)

    def arrays(part):
        h = torch.from_numpy(np.concatenate([t.hidden for t in part]).astype(np.float32))
        e = torch.from_numpy(np.concatenate([t.entropy for t in part]).astype(np.float32))
        m = torch.from_numpy(np.concatenate([t.max_logp for t in part]).astype(np.float32))
        return h, e, m

    y_all = [torch.from_numpy((a >= 1).astype(np.float32)) for a in accepts]
    train_x, val_x = arrays(traces[:half]), arrays(traces[half:] or traces[:half])
    train_y, val_y = torch.cat(y_all[:half]), torch.cat(y_all[half:] or y_all[:half])
    torch.manual_seed(seed)
    gate = GateGraph(hidden_size)
    opt = torch.optim.AdamW(gate.parameters(), lr=3e-3, weight_decay=0.05)
    pos_weight = None
    best, best_state, bad = float("inf"), None, 0
    for it in range(600):
        gate.train()
        logit = gate.gate_logit(*train_x)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, train_y, pos_weight=pos_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        gate.eval()
        with torch.no_grad():
            val = float(torch.nn.functional.binary_cross_entropy_with_logits(gate.gate_logit(*val_x), val_y))
        if val < best - 1e-4:
            best, best_state, bad = val, {k: v.clone() for k, v in gate.state_dict().items()}, 0
        else:
            bad += 1
            if bad >= 40:
                break
    gate.load_state_dict(best_state)
    gate.eval()
    with torch.no_grad():
        val_prob = torch.sigmoid(gate.gate_logit(*val_x)).numpy()
    report = {
        "train_positions": int(train_y.numel()), "val_positions": int(val_y.numel()),
        "val_positive_rate": round(float(val_y.mean()), 4), "val_bce": round(best, 4), "iterations": it + 1,
        "val_auc_learned": round(_auc(val_prob, val_y.numpy()), 4),
        "val_auc_entropy": round(_auc(-val_x[1].numpy(), val_y.numpy()), 4),
    }
    return gate, report


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    # average ranks of ties
    s_sorted = score[order]
    i = 0
    while i < len(s_sorted):
        j = i
        while j + 1 < len(s_sorted) and s_sorted[j + 1] == s_sorted[i]:
            j += 1
        if j > i:
            ranks[order[i : j + 1]] = (i + j + 2) / 2
        i = j + 1
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def gate_probs(gate, traces: list[Trace]) -> list[np.ndarray]:
    import torch

    out = []
    with torch.no_grad():
        for t in traces:
            x = (torch.from_numpy(t.hidden), torch.from_numpy(t.entropy.astype(np.float32)),
                 torch.from_numpy(t.max_logp.astype(np.float32)))
            out.append(torch.sigmoid(gate.gate_logit(*x)).numpy())
    return out


def sweep_gate(accepts, scores: list[np.ndarray], thresholds: np.ndarray, below: bool, costs: dict[str, float],
               tree: str, cost_gate: float) -> list[dict[str, float]]:
    rows = []
    for th in thresholds:
        drafts = [(sc < th) if below else (sc >= th) for sc in scores]
        tps, tau, frac = simulate(accepts, drafts, costs["ar"], costs[tree], cost_gate)
        rows.append({"threshold": round(float(th), 4), "tok_s": round(tps, 2), "tau": round(tau, 3),
                     "draft_fraction": round(frac, 3)})
    return rows
