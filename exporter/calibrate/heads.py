"""Calibrate a heads draft on held-in prompts: its default tree and, for Cerberus, which signal its gate reads.

The Cerberus paper sets the entropy threshold by hand per model and calls that a limitation. Here
the gate's signal is chosen to maximise tokens/s, from measurements on this machine (at run time the
gate then decides step by step from that signal and the measured costs: ``runtime/drafters/depth.py``):

1. **Trace.** Plain greedy decoding of ShareGPT first user turns (held-in prompts, never the
   MT-bench questions) through the runtime records, at every generated position s, the base hidden
   state that produced token s, the entropy and max log-prob of that distribution, and the reference
   continuation. The heads graph then runs once over all recorded hidden states.
2. **Acceptance.** Greedy verification accepts a tree path iff its tokens equal the reference
   continuation, so for every position, every candidate tree and every candidate draft vocabulary
   (full shared lm_head or a trimmed one) the accepted length is computed exactly, without running
   the base model again.
3. **Step costs.** The real decode loop is timed per step: plain T=1 steps, and always-draft steps
   for each candidate tree (heads graph + tree + verify), plus the heads graph of each vocabulary
   and the gate graph on their own. Runs are interleaved and the median taken, since this CPU is
   shared. The default tree and vocabulary are the pair with the most simulated tokens/s.
4. **Simulation.** Walking each trace as the loop would (a draft step at s advances
   1 + accepted(s), an AR step advances 1) and charging the measured costs gives tokens/s for any
   tree and any gate threshold, exactly reproducing the greedy trajectory. Thresholds are swept
   from "always AR" to "always draft", so the chosen gate is never slower, on these traces, than
   the better of gate-off and always-AR.
5. **Learned gate.** An MLP on ``[h ; entropy ; max log-prob]`` learns P(accepted >= 1) for the
   chosen tree from the traces of half the prompts, is checked on the other half (AUC), and its
   threshold is swept like the entropy gate's. The faster of the two becomes the gate's signal; its
   best threshold is kept in the calibration file as a record.
6. **Confirm.** The real loop runs fresh held-in prompts with AR, gate-off and the chosen gate, and
   the measured tokens/s go into the calibration file next to the simulated ones.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.exporter.calibrate.gate import gate_probs, sweep_gate, time_gate, train_learned_gate
from specdeploy.exporter.calibrate.traces import Trace, entropy_features, simulate
from specdeploy.exporter.train.weights import load_draft_weights, save_draft_weights
from specdeploy.runtime.bundle import hash_files
from specdeploy.runtime.contract import HIDDEN_STATES
from specdeploy.runtime.drafters.kinds import NONE, always_draft, describe

CANDIDATE_TREES = ("chain4", "tree8", "tree16", "tree32", "tree64", "dynamic:16", "dynamic:32")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def record_traces(engine, prompts: list[list[int]], max_new_tokens: int, progress: bool = True) -> list[Trace]:
    """Plain greedy decoding with a recording drafter (it always proposes the root alone)."""
    from specdeploy.runtime.decode import Decoder, GenerationConfig
    from specdeploy.runtime.drafters.base import DraftContext, Drafter
    from specdeploy.runtime.tree import DraftTree
    from tqdm import tqdm

    class Recorder(Drafter):
        kind = "recorder"

        def __init__(self) -> None:
            self.rows: list[tuple[np.ndarray, float, float]] = []

        def propose(self, ctx: DraftContext) -> DraftTree:
            self.rows.append((np.array(ctx.hidden[-1], dtype=np.float32), *entropy_features(ctx.root_logits)))
            return DraftTree(np.array([ctx.tokens[-1]], dtype=np.int64), np.array([-1], dtype=np.int64))

    traces = []
    for ids in tqdm(prompts, desc="tracing greedy decoding", unit="prompt", disable=not progress):
        rec = Recorder()
        dec = Decoder(engine.backend, engine.manifest, rec, max_tree=2, plan=engine.plan)
        out = list(dec.generate(ids, GenerationConfig(max_new_tokens)))
        # rec.rows[j] is the state before step j, whose root is out[j]: positions 0..len(rows)-1.
        n = len(rec.rows)
        if n < 2:
            continue
        traces.append(Trace(
            ref=np.asarray(out, dtype=np.int64),
            hidden=np.stack([r[0] for r in rec.rows]),
            entropy=np.array([r[1] for r in rec.rows]),
            max_logp=np.array([r[2] for r in rec.rows]),
        ))
    return traces


def cached_traces(engine, prompts: list[list[int]], max_new_tokens: int, progress: bool = True) -> list[Trace]:
    """:func:`record_traces`, kept on disk per (base weights, prompts, length): both kinds reuse one tracing."""
    import hashlib

    from specdeploy.exporter.source import cache_root

    key = hashlib.sha256(json.dumps([engine.manifest.source.weight_sha, prompts, max_new_tokens]).encode()).hexdigest()
    path = cache_root() / "calib-traces" / f"{key[:24]}.npz"
    if path.is_file():
        with np.load(path) as z:
            n = int(z["count"])
            return [Trace(z[f"ref{i}"], z[f"hidden{i}"], z[f"entropy{i}"], z[f"max_logp{i}"]) for i in range(n)]
    traces = record_traces(engine, prompts, max_new_tokens, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"count": np.array(len(traces))}
    for i, t in enumerate(traces):
        arrays.update({f"ref{i}": t.ref, f"hidden{i}": t.hidden, f"entropy{i}": t.entropy, f"max_logp{i}": t.max_logp})
    tmp = path.with_name(f".{path.stem}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return traces


def run_heads(session, traces: list[Trace]) -> None:
    for tr in traces:
        ids, logp = session.run(None, {HIDDEN_STATES: tr.hidden[None].astype(np.float32)})  # [1, S, K, k]
        tr.ids, tr.logp = ids[0], logp[0]


def static_acceptance(tr: Trace, spec) -> np.ndarray:
    """[S] draft tokens greedy verification accepts at each position for a static tree (exact)."""
    from specdeploy.runtime.tree import spec_arrays

    parents, depth, rank = spec_arrays(spec)  # [N], [N-1], [N-1]
    s_len, r_len = tr.ids.shape[0], tr.ref.shape[0]  # positions with a hidden state; reference tokens
    pos = np.arange(s_len)[:, None] + depth[None, :]  # [S, N-1] reference index each node must equal
    known = pos < r_len
    ref = np.where(known, tr.ref[np.minimum(pos, r_len - 1)], -1)
    tokens = tr.ids[:, depth - 1, rank]  # [S, N-1]
    match = (tokens == ref) & known
    ok = np.zeros((s_len, spec.num_nodes), dtype=bool)
    ok[:, 0] = True
    for n in range(1, spec.num_nodes):  # parents come first
        ok[:, n] = ok[:, parents[n]] & match[:, n - 1]
    return (ok[:, 1:] * depth[None, :]).max(axis=1, initial=0)


def dynamic_acceptance(tr: Trace, nodes: int) -> np.ndarray:
    from specdeploy.runtime.drafters.heads import dynamic_tree

    s_len, r_len = tr.ids.shape[0], tr.ref.shape[0]
    out = np.zeros(s_len, dtype=np.int64)
    for s in range(s_len):
        tree = dynamic_tree(tr.ids[s], tr.logp[s], int(tr.ref[s]), nodes)
        depth = tree.buffers().depth
        ok = np.zeros(tree.num_nodes, dtype=bool)
        ok[0] = True
        for n in range(1, tree.num_nodes):
            p = s + depth[n]
            ok[n] = ok[tree.parents[n]] and p < r_len and tree.tokens[n] == tr.ref[p]
        out[s] = int(depth[ok].max())
    return out


def acceptance(traces: list[Trace], tree: str) -> list[np.ndarray]:
    from specdeploy.runtime.tree_table import parse_tree_arg

    if tree.startswith("dynamic"):
        nodes = int(tree.split(":", 1)[1])
        return [dynamic_acceptance(tr, nodes) for tr in traces]
    spec = parse_tree_arg(tree)
    return [static_acceptance(tr, spec) for tr in traces]


def chain_accept(traces: list[Trace], depth: int, topk: int) -> list[list[float]]:
    """accept[d][r]: P(rank-r candidate at depth d+1 is right | the top-1 chain above it was right)."""
    hits = np.zeros((depth, topk))
    seen = np.zeros(depth)
    for tr in traces:
        s_len, r_len = tr.ids.shape[0], tr.ref.shape[0]
        alive = np.ones(s_len, dtype=bool)
        for d in range(depth):
            pos = np.arange(s_len) + 1 + d
            known = pos < r_len
            alive &= known
            ref = tr.ref[np.minimum(pos, r_len - 1)]
            eq = tr.ids[:, d, :topk] == ref[:, None]  # [S, k]
            seen[d] += alive.sum()
            hits[d] += (eq & alive[:, None]).sum(0)
            alive &= eq[:, 0]
    return (hits / np.maximum(seen, 1)[:, None]).round(4).tolist()


def measure_step_costs(engine, make_drafter: Callable[[str | None], Any], trees: list[str], prompt: list[int],
                       reps: int = 15, progress: Callable[[str], None] = _stderr) -> dict[str, float]:
    """Seconds per decode step of the loop's own stages: plain ("ar") and always-draft for each tree.

    After one prefill of ``prompt`` the stages of a step run repeatedly at the same context:
    ``propose`` (heads graph + tree), ``verify`` (the base step over the tree; it writes K/V only
    beyond the committed length, so repeating it changes nothing) and ``accept``. Configurations
    are interleaved round by round and the median of ``reps`` rounds taken: whole generations are
    too noisy on a shared CPU to rank trees (one round measured a 5-node step dearer than a 16-node one).
    """
    from specdeploy.runtime.decode import Decoder, SamplingParams
    from specdeploy.runtime.drafters.base import DraftContext
    from specdeploy.runtime.tree import DraftTree

    plain = Decoder(engine.backend, engine.manifest, None, plan=engine.plan)
    state, _ = plain.prefill(prompt)
    state.tokens.append(int(np.argmax(state.root_logits)))
    ctx = DraftContext(np.asarray(state.tokens, dtype=np.int64), state.hidden, state.root_logits,
                       engine.manifest.limits.max_tree)
    drafters = {t: make_drafter(t) for t in trees}
    rng = np.random.default_rng(0)
    greedy = SamplingParams()
    samples: dict[str, list[float]] = {k: [] for k in ["ar", *trees]}
    root = DraftTree(np.array([state.tokens[-1]], dtype=np.int64), np.array([-1], dtype=np.int64))
    for _ in range(reps + 1):  # the first round warms up and is dropped
        for name, times in samples.items():
            t0 = time.perf_counter()
            tree = root if name == "ar" else drafters[name].propose(ctx)
            buffers = tree.buffers()
            out = plain.verify(state, tree, buffers)
            plain.accept(tree, buffers, out, greedy, rng, len(state.tokens))
            times.append(time.perf_counter() - t0)
    costs = {k: float(np.median(v[1:])) for k, v in samples.items()}
    progress(f"  step costs (median of {reps}): " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in costs.items()))
    return costs


def time_heads(session, hidden_size: int, repeats: int = 200) -> float:
    """Median seconds of one heads-graph call on a single row (what a decode step runs)."""
    x = np.random.default_rng(0).standard_normal((1, 1, hidden_size)).astype(np.float32)
    for _ in range(10):
        session.run(None, {HIDDEN_STATES: x})
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, {HIDDEN_STATES: x})
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def calibrate(bundle: str | Path, kind: str, draft: str | Path, prompts: int = 24, max_new_tokens: int = 128,
              confirm_prompts: int = 6, threads: int = 2, trees: tuple[str, ...] = CANDIDATE_TREES,
              trims: tuple[int, ...] | None = None, progress: Callable[[str], None] = _stderr,
              show_progress: bool = True, source: str | None = None) -> dict[str, Any]:
    """Calibrate a draft against ``bundle``; writes ``<draft>.calibration.json`` and updates the bundle.

    Chooses the draft vocabulary (``trims``: candidate sizes, 0 = the full shared lm_head; default
    the trained size and 8192), the default tree and, for Cerberus, the gate and its threshold.
    The learned gate's weights are added to ``draft`` (rewritten atomically).
    """
    from specdeploy.exporter.export.draft import calibration_path, export_draft
    from specdeploy.exporter.train.sharegpt import heldin_prompts
    from specdeploy.runtime import load
    from specdeploy.runtime.backends.ort import make_session
    from specdeploy.runtime.bundle import read_manifest
    from specdeploy.runtime.drafters.heads import cpu_graph_role, draft_graph, make_heads_drafter

    bundle, draft = Path(bundle), Path(draft)
    t0 = time.time()
    gate_role = describe(kind).gate_role  # a gated kind (Cerberus) has its gate calibrated too
    weights = load_draft_weights(draft, kind)
    trims = tuple(dict.fromkeys(trims if trims is not None else (weights.vocab_trim, 8192)))
    hidden_size = weights.config.hidden_size
    engine = load(bundle, draft=None, threads=threads)
    try:
        ids_all = heldin_prompts(lambda m: engine.encode(messages=m), prompts + confirm_prompts, source=source)
        calib_ids, confirm_ids = ids_all[:prompts], ids_all[prompts:]
        progress(f"[1/5] greedy traces of {len(calib_ids)} held-in ShareGPT prompts x {max_new_tokens} tokens ...")
        traces = cached_traces(engine, calib_ids, max_new_tokens, show_progress)

        progress(f"[2/5] acceptance of every candidate tree at every position, vocabularies {list(trims)} ...")
        accepts: dict[tuple[int, str], list[np.ndarray]] = {}
        heads_s: dict[int, float] = {}
        chain: dict[int, list] = {}
        for trim in trims:  # the last one exported stays in the bundle for the cost measurements
            export_draft(bundle, kind, draft, vocab_trim=trim, progress=lambda m: None, use_calibration=False)
            manifest = read_manifest(bundle)
            entry = manifest.draft(kind)
            session = make_session(bundle / draft_graph(entry, cpu_graph_role(entry)).file, "cpu", threads)
            run_heads(session, traces)
            heads_s[trim] = time_heads(session, hidden_size)
            for t in trees:
                accepts[(trim, t)] = acceptance(traces, t)
            chain[trim] = chain_accept(traces, int(entry.setting("num_heads")), int(entry.setting("topk")))
        measured_trim = trims[-1]

        progress("[3/5] measuring step costs of the real loop (interleaved, median) ...")
        draft_name = always_draft(kind)
        cost_prompt = (confirm_ids or calib_ids)[0] + [int(t) for t in traces[0].ref[:64]]  # a mid-answer context
        measured = measure_step_costs(
            engine, lambda t: make_heads_drafter(draft_name, bundle, manifest, tree=t, threads=threads),
            list(trees), cost_prompt, progress=progress)
        gate_s = 0.0
        if gate_role:
            gate_session = make_session(bundle / draft_graph(entry, gate_role.role).file, "cpu", threads)
            gate_s = time_gate(gate_session, traces, manifest.model.vocab_size)

        def cost(trim: int, tree: str) -> float:
            """A draft step with another vocabulary differs by its heads-graph time only."""
            return measured[tree] - heads_s[measured_trim] + heads_s[trim]

        always_ar = [np.zeros(tr.ids.shape[0], dtype=bool) for tr in traces]
        always = [np.ones(tr.ids.shape[0], dtype=bool) for tr in traces]
        ar_tps = simulate(accepts[(trims[0], trees[0])], always_ar, measured["ar"], measured["ar"], 0.0)[0]
        rows = {}
        for (trim, t), acc in accepts.items():
            tps, tau, _ = simulate(acc, always, measured["ar"], cost(trim, t), 0.0)
            rows[(trim, t)] = {"vocab_trim": trim, "tree": t, "tau": round(tau, 3), "sim_tok_s": round(tps, 2),
                               "step_ms": round(1e3 * cost(trim, t), 2)}
        best_trim, best_tree = max(rows, key=lambda key: rows[key]["sim_tok_s"])
        progress("  always draft: " + ", ".join(
            f"{t}/{trim or 'full'} tau {r['tau']:.2f} {r['sim_tok_s']:.1f} tok/s" for (trim, t), r in rows.items())
            + f"; plain {ar_tps:.1f} tok/s -> {best_tree} with vocabulary {best_trim or 'full'}")

        calib: dict[str, Any] = {
            "kind": kind, "base_weight_sha": weights.config.base_weight_sha,
            "default_tree": best_tree, "vocab_trim": int(best_trim), "accept": chain[best_trim],
            "costs_ms": {"ar_step": round(1e3 * measured["ar"], 3), "gate": round(1e3 * gate_s, 4),
                         **{f"heads[{trim or 'full'}]": round(1e3 * v, 3) for trim, v in heads_s.items()},
                         **{f"draft_step[{t}]": round(1e3 * measured[t], 3) for t in trees},
                         "draft_steps_measured_with_vocab": measured_trim},
            "candidates": list(rows.values()), "sim_ar_tok_s": round(ar_tps, 2),
            "prompts": {"source": "ShareGPT first user turns (held-in; not MT-bench)", "count": len(traces),
                        "max_new_tokens": max_new_tokens, "positions": int(sum(t.ref.shape[0] for t in traces)),
                        "confirm_count": len(confirm_ids)},
            "threads": threads,
        }
        best_row = rows[(best_trim, best_tree)]
        if gate_role:
            progress("[4/5] gate: entropy threshold sweep, learned gate fit and sweep ...")
            acc = accepts[(best_trim, best_tree)]
            costs = {"ar": measured["ar"], best_tree: cost(best_trim, best_tree)}
            ent = [t.entropy for t in traces]
            grid = np.unique(np.concatenate([[0.0], np.quantile(np.concatenate(ent), np.linspace(0, 1, 41)),
                                             [float(np.log(manifest.model.vocab_size))]]))
            ent_rows = sweep_gate(acc, ent, grid, True, costs, best_tree, gate_s)
            gate, gate_report = train_learned_gate(traces, acc, hidden_size)
            learned_rows = sweep_gate(acc, gate_probs(gate, traces), np.linspace(0.0, 1.0, 41), False, costs,
                                      best_tree, gate_s)
            best_ent = max(ent_rows, key=lambda r: r["tok_s"])
            best_learned = max(learned_rows, key=lambda r: r["tok_s"])
            choice = ("entropy", best_ent) if best_ent["tok_s"] >= best_learned["tok_s"] else ("learned", best_learned)
            calib["gate"] = {"kind": choice[0], "threshold": choice[1]["threshold"], "sim_tok_s": choice[1]["tok_s"],
                             "entropy": {"best": best_ent, "sweep": ent_rows},
                             "learned": {"best": best_learned, "sweep": learned_rows, "fit": gate_report},
                             "gate_off_sim_tok_s": best_row["sim_tok_s"], "always_ar_sim_tok_s": round(ar_tps, 2)}
            progress(f"  entropy gate < {best_ent['threshold']:.3f}: {best_ent['tok_s']:.1f} tok/s "
                     f"(drafts {best_ent['draft_fraction']:.0%}); learned gate >= {best_learned['threshold']:.3f}: "
                     f"{best_learned['tok_s']:.1f} tok/s (AUC {gate_report['val_auc_learned']:.3f} vs entropy "
                     f"{gate_report['val_auc_entropy']:.3f}); gate off {best_row['sim_tok_s']:.1f}, "
                     f"always AR {ar_tps:.1f} -> {choice[0]}")
            tensors = dict(weights.tensors)
            tensors.update({f"gate.{k}": v for k, v in gate.state_dict().items()})
            meta = dict(weights.meta)
            meta["gate"] = {"fit": gate_report, "features": "[h ; entropy ; max log-prob]"}
            save_draft_weights(draft, weights.config, tensors, meta)
        calib["weights_sha"] = hash_files([draft])
        calib["calibration_seconds"] = round(time.time() - t0, 1)
        cpath = calibration_path(draft)
        _write_json(cpath, calib)
    finally:
        engine.close()

    progress("[5/5] re-exporting with the calibration and confirming on fresh prompts with the real loop ...")
    export_draft(bundle, kind, draft, calibration=cpath, progress=lambda m: None)
    if confirm_ids:
        calib["confirm"] = confirm(bundle, kind, confirm_ids, max_new_tokens, threads)
        progress("  measured tok/s: " + ", ".join(f"{k} {v['tok_s']:.1f} (tau {v['tau']:.2f})"
                                                   for k, v in calib["confirm"].items()))
        calib["calibration_seconds"] = round(time.time() - t0, 1)
        _write_json(cpath, calib)
    return calib


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def confirm(bundle: Path, kind: str, prompts: list[list[int]], max_new_tokens: int, threads: int) -> dict[str, Any]:
    """The real loop on fresh prompts, variants interleaved per prompt: decode tokens/s and tau."""
    from specdeploy.runtime import load
    from specdeploy.runtime.decode import DecodeStats, GenerationConfig

    names = [NONE, *dict.fromkeys((always_draft(kind), kind))]  # plain, always draft, and gated where it has a gate
    engines = {n: load(bundle, draft=n, threads=threads) for n in names}
    totals = {n: [0, 0.0, 0, 0, 0] for n in names}  # tokens, seconds, steps, gate_ar, identical
    try:
        for ids in prompts:
            ref = None
            for n in names:
                st = DecodeStats()
                out = engines[n].generate_ids(ids, GenerationConfig(max_new_tokens), st)
                ref = out if ref is None else ref
                t = totals[n]
                t[0] += st.new_tokens - 1
                t[1] += st.decode_s
                t[2] += st.steps
                t[3] += st.gate_ar
                t[4] += int(out == ref)
    finally:
        for e in engines.values():
            e.close()
    return {("ar" if n == NONE else n): {"tok_s": round(t[0] / max(t[1], 1e-9), 2), "tau": round(t[0] / max(t[2], 1), 3),
                                           "gate_ar_fraction": round(t[3] / max(t[2], 1), 3),
                                           "identical": f"{t[4]}/{len(prompts)}"}
            for n, t in totals.items()}

