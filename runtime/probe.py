"""The exactness probe behind the step plan (:mod:`.plan`): plain rows against chain and tree rows, bit for bit.

:func:`resolve_plan` probes each candidate plan in order (verdicts cached per machine, :mod:`.verdicts`) and
returns the fastest exact one; see :mod:`.plan` for why nothing is assumed and :mod:`.plan_choice` for the
candidates and the choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .bitwise import gap, host_copy
from .decode import Decoder
from .errors import StepPlanError
from .plan import LONE, PROBE_LONG, PROBE_PROMPT, Candidate, ProbeCheck, ProbeResult, StepPlan
from .plan_choice import asked_for, candidates, choose, probe_depth
from .rows import SeqRows, step_inputs
from .tree import DraftTree
from .verdicts import cached_verdict, store_verdict, verdict_key

if TYPE_CHECKING:
    from .backends.base import Backend
    from .bundle import BundleManifest
    from .kvcache import KVCache


# --- the probe ------------------------------------------------------------------------------------
def probe(backend: Backend, manifest: BundleManifest, cand: Candidate, depth: int) -> ProbeResult:
    """Plain steps against chain steps of every length 2..``depth`` and one tree, bit for bit.

    From one prefilled context, plain steps feed tokens ``t_0..t_{depth-1}`` one at a time
    (teacher-forced, the way plain decoding would emit them); from the same context, a chain step of
    each length T must give every row's logits, hidden state and K/V exactly as the plain steps did.
    The chains are checked at two contexts, :data:`PROBE_PROMPT` tokens and :data:`PROBE_LONG` (where
    the bundle's context allows), since kernels may switch with the key length. The tree (at both contexts)
    is the path ``t_0 -> t_1 -> .. -> t_m`` with a sibling ``z`` inserted before each path node
    (``[t_0, z, t_1, z, t_2, ..]``, ``2m + 1 <= depth`` nodes), so that every path node's ancestors lie at
    cache slots that are not adjacent, as a branching draft's do.
    """
    dec = Decoder(backend, manifest, None, plan=_probe_plan(cand, depth))
    v = manifest.model.vocab_size
    tokens = [(101 + 104729 * i) % v for i in range(depth + 1)]
    contexts = [PROBE_PROMPT] + ([PROBE_LONG] if PROBE_LONG + depth + 2 <= manifest.limits.max_context else [])
    backend.use_split(cand.split)
    backend.use_gathered(cand.gathered)
    times: list[float] = []
    checks: list[ProbeCheck] = []
    try:
        for n_ctx in contexts:
            prompt = [(17 + 7919 * i) % v for i in range(n_ctx)]
            tag = "" if n_ctx == PROBE_PROMPT else f" @{n_ctx}"
            ok = _chains_and_tree(dec, prompt, tokens, depth, tag, times, checks)
            if not ok:
                break
        if ok and cand.gathered and backend.can_batch_rows:  # the layout that batches: a sequence's rows among others'
            checks += probe_rows(dec, tokens)
        return ProbeResult(cand, tuple(checks), 1000 * float(np.median(times)))
    finally:
        backend.use_split(True)
        backend.use_gathered(False)


def _chains_and_tree(dec: Decoder, prompt: list[int], tokens: list[int], depth: int, tag: str, times: list[float],
                     checks: list[ProbeCheck]) -> bool:
    """One context's checks, appended to ``checks``; False once one differs (the rest would not change
    the verdict)."""
    state, _ = dec.prefill(prompt)
    cache, p = state.cache, state.cache.length
    cache.ensure_capacity(p + depth + 2, dec.buckets)

    def run(tree: DraftTree, start: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        cache.length, n = start, len(tree.tokens)
        out = dec.verify(state, tree, tree.buffers())
        kv = [host_copy(b[:, :, start : start + n]) for b in cache.buffers()]  # the rows this step wrote
        return out.logits[0, :n], out.hidden_states[0, :n], kv

    plain_logits, plain_hidden, plain_kv = [], [], []

    def plain_step(i: int) -> None:
        t0 = time.perf_counter()
        lg, hd, kv = run(DraftTree.root(tokens[i]), p + i)
        times.append(time.perf_counter() - t0)
        plain_logits.append(lg[0])
        plain_hidden.append(hd[0])
        plain_kv.append([k[:, :, 0] for k in kv])

    def rows_gap(keep: list[int], lg: np.ndarray, hd: np.ndarray, kv: list[np.ndarray]) -> float:
        return max(gap(lg[keep], np.stack([plain_logits[i] for i in range(len(keep))])),
                   gap(hd[keep], np.stack([plain_hidden[i] for i in range(len(keep))])),
                   max(gap(kv[j][:, :, keep], np.stack([plain_kv[i][j] for i in range(len(keep))], axis=2))
                       for j in range(len(kv))))

    # Plain steps are taken as the chains need them: plain step i reads slots p..p+i-1, which the
    # chain of length i (checked just before) wrote bit for bit as plain steps would have, so a
    # failing candidate costs a few steps, not the whole depth.
    plain_step(0)
    for t in range(2, depth + 1):
        plain_step(t - 1)
        checks.append(ProbeCheck(f"chain T={t}{tag}", rows_gap(list(range(t)), *run(DraftTree(
            np.asarray(tokens[:t]), np.arange(-1, t - 1)), p))))
        if checks[-1].max_abs:
            return False
    if depth >= 3:
        # the path t_0 -> t_1 -> ... -> t_m with a sibling before each of its nodes, so that every path node's
        # ancestors are interleaved with nodes it must not see
        toks, parents, path = [tokens[0]], [-1], [0]
        for j in range(1, (depth - 1) // 2 + 1):
            toks += [tokens[depth], tokens[j]]
            parents += [path[-1], path[-1]]
            path.append(len(toks) - 1)
        nodes = DraftTree(np.asarray(toks), np.asarray(parents))
        checks.append(ProbeCheck("tree" + tag, rows_gap(path, *run(nodes, p))))
    return True


def _probe_plan(cand: Candidate, depth: int) -> StepPlan:
    return StepPlan(cand, speculate=True, exact=False, trees=True, max_rows=max(depth, 4), reason="probing")


def resolve_plan(backend: Backend, manifest: BundleManifest, allow_inexact: bool = False, use_cache: bool = True,
                 progress: Callable[[str], None] | None = None, step_plan: str | None = None) -> StepPlan:
    """Probe the candidates in order (cached per machine) and return the fastest exact plan.

    No exact candidate: plain decoding with the fastest candidate, or with ``allow_inexact`` speculation
    there, labelled lossy. The probe depth is the bundle's tree limit, at most :data:`~.plan.PROBE_DEPTH`.
    ``step_plan`` names a candidate to take instead (:func:`~.plan_choice.asked_for`: probed like the others, and
    refused where it is not exact, unless ``allow_inexact``), or is :data:`~.plan.LONE`: the fastest exact plan
    for one sequence at a time, whether or not its rows batch (the exactness tax's baseline).
    """
    depth = probe_depth(manifest.limits.max_tree)
    results: list[ProbeResult] = []

    def verdict(cand: Candidate) -> ProbeResult:
        key = verdict_key(backend, manifest, cand, depth)
        res = cached_verdict(key) if use_cache else None
        if res is None:
            if progress is not None:
                progress(f"probing exactness of the '{cand.name}' step plan on this machine ...")
            res = probe(backend, manifest, cand, depth)
            if use_cache:
                store_verdict(key, res)
        results.append(res)
        return res

    cands = candidates(backend, depth)
    if step_plan is not None and step_plan != LONE:
        named = next((c for c in cands if c.name == step_plan), None)
        if named is None:
            raise StepPlanError(f"The {backend.name} backend has no '{step_plan}' step plan for this bundle; it has "
                                f"{', '.join(c.name for c in cands)}.")
        return asked_for(verdict(named), depth, allow_inexact)
    for cand in (c for c in cands if not c.gathered):
        if verdict(cand).chains_exact:
            break
    for cand in (c for c in cands if c.gathered):  # exact trees by construction; rows of several sequences?
        if verdict(cand).rows_exact:
            break
    return choose(results, depth, allow_inexact, rows_first=step_plan != LONE)


# --- the probe: a sequence's rows among other sequences' -----------------------------------------------
ROWS_PROMPT = 300  # the probed sequence's context: past 256 columns, where ONNX Runtime's products block sums
_OTHERS = (-37, 23, -90, 61, -5)  # the other sequences' context lengths, against the probed one's


def probe_rows(dec: Decoder, tokens: Sequence[int]) -> list[ProbeCheck]:
    """Whether a sequence's rows are, bit for bit, its rows alone when other sequences share the step.

    The sequence's plain steps of ``tokens[0..2]`` alone, on ``dec``'s plan (its padding rows included), are
    the reference. Then the same sequence runs in batches whose other sequences hold other text of other
    lengths, in a cache of another capacity, each prompt prefilled alone and copied in (as the scheduler joins
    one): as row 1 of 3 verifying the chain ``tokens[0..2]`` beside a plain row and a 2-row chain (so with
    its own draft rows and padding rows), and as row 4 of 6 plain steps. Logits, hidden states and the K/V
    it writes must all agree."""
    backend, manifest = dec.backend, dec.manifest
    v = manifest.model.vocab_size
    n = max(8, min(ROWS_PROMPT, manifest.limits.max_context - max(_OTHERS) - 2 * dec.max_tree - 8))

    def prompt(seed: int, length: int) -> list[int]:
        return [(seed + 7919 * i) % v for i in range(length)]

    state, _ = dec.prefill(prompt(17, n))
    alone = []
    for i in range(3):  # plain steps, as Decoder.verify runs them on this plan
        root = DraftTree.root(tokens[i])
        out = dec.verify(state, root, root.buffers())
        kv = [host_copy(b[0, :, n + i]) for b in state.cache.buffers()]
        alone.append((host_copy(out.logits[0, 0]), host_copy(out.hidden_states[0, 0]), kv))
        state.cache.length += 1
    mine = (prompt(17, n), state.cache)
    others = [prompt(5 + 97 * j, max(4, n + d)) for j, d in enumerate(_OTHERS)]  # a short context: shorter others
    joined: dict[int, KVCache] = {}

    def batch(spec: list[tuple[list[int], DraftTree]], row: int) -> list[tuple]:
        cache = backend.new_cache(len(spec), max(len(p) for p, _ in spec) + 2 * dec.max_tree + 24)
        for r, (ids, _) in enumerate(spec):
            src = mine[1] if ids is mine[0] else joined.get(id(ids))
            if src is None:
                src = joined[id(ids)] = dec.prefill(ids)[0].cache
            for dst, buf in zip(cache.buffers(), src.buffers()):
                dst[r, :, : len(ids)] = buf[0, :, : len(ids)]
        backend.forget_buffers()  # nothing may alias the caches made so far
        rows = max(max(len(t.tokens) for _, t in spec), dec.min_rows)
        out = backend.step(step_inputs([SeqRows(len(p), t) for p, t in spec], rows, cache.capacity,
                                       backend.mask_dtype), cache)
        backend.forget_buffers()
        k = len(spec[row][1].tokens)
        return [(out.logits[row, j], out.hidden_states[row, j], [host_copy(b[row, :, n + j]) for b in cache.buffers()])
                for j in range(k)]

    chain = DraftTree(np.asarray(tokens[:3]), np.arange(-1, 2))
    runs = {
        "batch rows: 3 sequences, its chain of 3": batch(
            [(others[0], DraftTree.root(3)), (mine[0], chain), (others[1], DraftTree.chain([5, 6]))], 1),
        "batch rows: 6 sequences, plain": batch(
            [(others[0], DraftTree.root(3)), (others[1], DraftTree.root(4)), (others[2], DraftTree.root(5)),
             (others[3], DraftTree.root(6)), (mine[0], DraftTree.root(tokens[0])), (others[4], DraftTree.root(7))], 4),
    }
    checks = []
    for what, got in runs.items():
        worst = max(max(gap(a[0], b[0]), gap(a[1], b[1]), max(gap(x, y) for x, y in zip(a[2], b[2])))
                    for a, b in zip(alone, got))
        checks.append(ProbeCheck(what, worst))
    backend.forget_buffers()
    return checks
