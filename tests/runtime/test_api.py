"""The embedding API: load / generate / stream, thread safety, cancellation, close, and the README example."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from specdeploy.runtime import SpecDeployError, load
from specdeploy.runtime import engine as engine_module

EXAMPLE = Path(__file__).resolve().parents[1] / "api_example.py"
PROMPTS = [f"Question {i}: what is the capital of country number {i}?" for i in range(6)]


@pytest.fixture(scope="module")
def engine(tiny_bundle):
    with load(tiny_bundle, draft=None) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, str]:
    return {p: engine.generate(p, max_new_tokens=24).text for p in PROMPTS}


def test_readme_example_runs_as_written(tiny_bundle):
    """tests/api_example.py is the README's example; it runs unchanged against a bundle."""
    env = dict(os.environ, SPECDEPLOY_BUNDLE=str(tiny_bundle))
    res = subprocess.run([sys.executable, str(EXAMPLE)], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "tok/s, tau" in res.stdout


def test_readme_example_matches_the_docstring():
    doc = engine_module.__doc__ or ""
    snippet = textwrap.dedent(doc[doc.index("    import os"):doc.index("(That snippet")]).strip() + "\n"
    assert snippet == EXAMPLE.read_text()


def test_runtime_import_stays_lean():
    code = ("import sys, specdeploy.runtime; "
            "heavy = {'torch', 'transformers', 'fastapi', 'starlette', 'uvicorn', 'pydantic'} & "
            "{m.split('.')[0] for m in sys.modules}; print(sorted(heavy))")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_stream_equals_generate(engine, reference):
    prompt = PROMPTS[0]
    stream = engine.stream(prompt, max_new_tokens=24)
    assert stream.prompt_tokens == len(engine.encode(prompt))
    text = "".join(stream)
    assert text == reference[prompt]
    assert stream.completion is not None and stream.completion.text == text
    st = stream.completion.stats
    assert st.new_tokens == 24 and stream.completion.finish_reason == "length"
    assert st.tokens_per_s > 0 and st.mean_accepted >= 1.0 and st.steps == 23


def test_stop_accepts_a_single_string(engine, reference):
    full = reference[PROMPTS[1]]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    out = engine.generate(PROMPTS[1], max_new_tokens=24, stop=stop)
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]


def test_concurrent_callers_are_queued_not_interleaved(engine, reference):
    before = engine.stats()
    results: dict[int, str] = {}

    def work(i: int) -> None:
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            results[i] = "".join(engine.stream(p, max_new_tokens=24))
        else:
            results[i] = engine.generate(p, max_new_tokens=24).text

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert all(results[i] == reference[PROMPTS[i % len(PROMPTS)]] for i in range(12))
    after = engine.stats()
    assert after.generations - before.generations == 12
    assert after.new_tokens - before.new_tokens == 12 * 24
    assert after.queue_depth == 0 and after.running == 0


def test_queue_is_first_come_first_served(engine):
    holder = engine.stream(PROMPTS[0], max_new_tokens=200)
    next(holder)  # holds the decode slot
    order: list[int] = []

    def work(i: int) -> None:
        engine.generate(PROMPTS[i], max_new_tokens=4)
        order.append(i)

    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=work, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while engine.stats().queue_depth < i + 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.stats().queue_depth == i + 1
    holder.close()
    for t in threads:
        t.join(30)
    assert order == [0, 1, 2, 3]
    assert holder.completion is not None and holder.completion.finish_reason == "cancelled"


def test_closing_a_stream_frees_the_slot_from_any_thread(engine, reference):
    # Closed between deltas, in the consuming thread.
    stream = engine.stream(PROMPTS[2], max_new_tokens=200)
    next(stream)
    stream.close()
    assert stream.completion is not None and stream.completion.finish_reason == "cancelled"
    assert engine.stats().running == 0

    # Closed from another thread while the consumer is inside next().
    running = engine.stream(PROMPTS[3], max_new_tokens=480)
    seen: list[str] = []
    consumer = threading.Thread(target=lambda: seen.extend(running))
    consumer.start()
    while not seen and consumer.is_alive():
        time.sleep(0.001)
    running.close()
    consumer.join(10)
    assert not consumer.is_alive()
    assert running.completion is not None and running.completion.finish_reason == "cancelled"
    assert running.completion.stats.new_tokens < 480

    # A queued stream that is closed leaves the queue without running.
    holder = engine.stream(PROMPTS[0], max_new_tokens=200)
    next(holder)
    queued = engine.stream(PROMPTS[1], max_new_tokens=8)
    waiter = threading.Thread(target=lambda: list(queued))
    waiter.start()
    while engine.stats().queue_depth < 1:
        time.sleep(0.005)
    queued.close()
    waiter.join(5)
    assert not waiter.is_alive() and queued.completion is not None
    assert queued.completion.finish_reason == "cancelled" and queued.completion.stats.new_tokens == 0
    holder.close()
    assert engine.generate(PROMPTS[0], max_new_tokens=24).text == reference[PROMPTS[0]]


def test_close_cancels_and_context_manager(tiny_bundle):
    with load(tiny_bundle, draft=None) as eng:
        suspended = eng.stream(PROMPTS[0], max_new_tokens=200)
        next(suspended)  # suspended while holding the slot: close() must not deadlock on it
        queued = eng.stream(PROMPTS[1], max_new_tokens=8)
        waiter = threading.Thread(target=lambda: list(queued))
        waiter.start()
        while eng.stats().queue_depth < 1:
            time.sleep(0.005)
    assert eng.closed
    waiter.join(5)
    assert not waiter.is_alive()
    assert suspended.completion is not None and suspended.completion.finish_reason == "cancelled"
    assert queued.completion is not None and queued.completion.finish_reason == "cancelled"
    with pytest.raises(SpecDeployError, match="closed"):
        eng.generate("hello")
    eng.close()  # idempotent


def test_generate_ids_shares_the_queue(engine, reference):
    from specdeploy.runtime.decode import GenerationConfig

    ids = engine.encode(PROMPTS[4])
    out: list[list[int]] = []
    t = threading.Thread(target=lambda: out.append(engine.generate_ids(ids, GenerationConfig(24))))
    text = engine.generate(PROMPTS[4], max_new_tokens=24)
    t.start()
    t.join(30)
    assert out and tuple(out[0]) == text.token_ids


def test_stats_snapshot(engine):
    before = engine.stats()
    engine.generate(PROMPTS[5], max_new_tokens=8)
    stream = engine.stream(PROMPTS[5], max_new_tokens=8)
    next(stream)
    stream.close()
    st = engine.stats()
    assert st.generations == before.generations + 2 and st.cancelled == before.cancelled + 1
    assert st.new_tokens > before.new_tokens + 8 and st.busy_s > before.busy_s
    assert st.tokens_per_s > 0 and st.tau >= 1.0 and st.last_tokens_per_s > 0
