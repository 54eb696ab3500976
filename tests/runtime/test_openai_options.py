"""OpenAI request options beyond a single answer's text. Log-probabilities (runtime/logprobs.py): the log-softmax of
the row that chose each token, bit for bit the same whether the token was drafted or decoded plainly, alone or in a
batch, in the server's OpenAI forms. ``n`` choices, streamed or not, with ``seed`` and ``include_usage``."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from decode_checks import concurrently
from serving import Server
from specdeploy.runtime import load
from specdeploy.runtime.decode import GenerationConfig
from specdeploy.runtime.errors import PromptError
from specdeploy.runtime.logprobs import token_logprobs

REPETITIVE = ["one two three four one two three four one two three four one two",
              "the cat sat on the mat and the cat sat on the mat and the cat",
              "a b c d e f g a b c d e f g a b c d"]


def test_a_token_logprob_is_the_log_softmax_of_its_row():
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((3, 500)) * 4).astype(np.float32)
    rows[2, 7] = rows[2, 9] = rows[2].max() + 1  # a tie at the top: the lower id first
    got = token_logprobs(rows, [5, 17, 9], top=4)
    for row, tok, e in zip(rows.astype(np.float64), [5, 17, 9], got):
        ref = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert e.token == tok and e.logprob == pytest.approx(ref[tok], abs=1e-5)
        assert [t for t, _ in e.top] == sorted(range(500), key=lambda i: (-row[i], i))[:4]
        assert [lp for _, lp in e.top] == pytest.approx(ref[[t for t, _ in e.top]], abs=1e-5)
    assert [t for t, _ in got[2].top][:2] == [7, 9]
    assert token_logprobs(rows, [1], top=0)[0].top == ()
    with pytest.raises(PromptError, match="top_logprobs"):
        GenerationConfig(8, logprobs=21)


def test_drafted_tokens_have_the_logprobs_plain_decoding_reports(tiny_bundle):
    kw = {"max_new_tokens": 40, "logprobs": 3}
    with load(tiny_bundle, draft=None) as plain:
        want = [plain.generate(p, **kw) for p in REPETITIVE]
        sampled = plain.generate(REPETITIVE[0], temperature=0.8, seed=11, **kw)
    assert all(len(w.logprobs) == len(w.token_ids) for w in want)
    assert all(e.top[0][0] == e.token for w in want for e in w.logprobs)  # greedy: the chosen token is the best
    for max_batch in (1, 4):
        with load(tiny_bundle, draft="prompt-lookup", max_batch=max_batch) as spec:
            got = concurrently(spec, REPETITIVE, **kw) if max_batch > 1 else [spec.generate(p, **kw) for p in REPETITIVE]
            again = spec.generate(REPETITIVE[0], temperature=0.8, seed=11, **kw)
        assert max(max(g.stats.tree_sizes) for g in got) > 1  # tokens were drafted and verified
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids and g.logprobs == w.logprobs  # floats equal, bit for bit
        assert again.token_ids == sampled.token_ids and again.logprobs == sampled.logprobs


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    srv = Server(tiny_bundle, tmp_path_factory.mktemp("serve_lp") / "server.log", "--draft", "prompt-lookup")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_the_server_reports_logprobs_in_openai_form(server, tiny_bundle):
    with load(tiny_bundle, draft=None) as plain:
        want = plain.generate(messages=[{"role": "user", "content": REPETITIVE[0]}], max_new_tokens=24, logprobs=2)
        comp = plain.generate(REPETITIVE[1], max_new_tokens=16, logprobs=3)
        token_text = [plain.codec.decode([e.token], skip_special_tokens=False) for e in want.logprobs]
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": REPETITIVE[0]}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, logprobs=True,
                                           top_logprobs=2)
        content = r.choices[0].logprobs.content
        assert [c.token for c in content] == token_text and r.usage.completion_tokens == len(content)
        assert [c.logprob for c in content] == [e.logprob for e in want.logprobs]
        assert [[t.logprob for t in c.top_logprobs] for c in content] == [[lp for _, lp in e.top] for e in want.logprobs]
        assert all(c.bytes == list(c.token.encode()) for c in content)
        chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                                     logprobs=True, top_logprobs=2, stream=True))
        streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
        assert [c.logprob for c in streamed] == [c.logprob for c in content]
        plain_r = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
        assert plain_r.choices[0].logprobs is None  # not asked, not sent
    body = {"model": model, "prompt": REPETITIVE[1], "max_tokens": 16, "temperature": 0, "logprobs": 3}
    lp = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [e.logprob for e in comp.logprobs]
    assert [list(d.values()) for d in lp["top_logprobs"]] == [[x for _, x in e.top] for e in comp.logprobs]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for bad, param in (({"logprobs": 6}, "logprobs"),):
        r = httpx.post(server.url + "/v1/completions", json=body | bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 3}):
        r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(chat | bad), timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
        assert r.json()["error"]["message"].endswith(".")


def test_n_choices_with_a_seed_streamed_or_not(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Name three colours."}]
        kw = {"model": model, "messages": msgs, "max_tokens": 12, "temperature": 1.0, "seed": 5}
        three = client.chat.completions.create(n=3, **kw)
        assert [c.index for c in three.choices] == [0, 1, 2]
        one = client.chat.completions.create(**kw)
        assert three.choices[0].message.content == one.choices[0].message.content  # choice i samples with seed + i
        assert len({c.message.content for c in three.choices}) > 1  # other seeds, other samples
        assert three.usage.completion_tokens == sum(
            len(client.chat.completions.create(**(kw | {"seed": 5 + i}), logprobs=True).choices[0].logprobs.content)
            for i in range(3))
        text = {0: "", 1: "", 2: ""}
        usage = None
        for chunk in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
            for choice in chunk.choices:
                text[choice.index] += choice.delta.content or ""
            usage = chunk.usage or usage
        assert [text[i] for i in range(3)] == [c.message.content for c in three.choices]
        assert usage is not None and usage.completion_tokens == three.usage.completion_tokens
    r = httpx.post(server.url + "/v1/chat/completions", json=kw | {"n": 17}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
