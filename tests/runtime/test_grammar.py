"""Constrained decoding (runtime/grammar.py): output that matches its JSON schema, regex or grammar; speculative
constrained output equal to plain constrained output for every draft source, alone and in a batch; the grammar's
forced tokens drafted; sampling from the masked distribution exactly (chi-square); one sentence for bad input."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from decode_checks import concurrently, pairs_fit
from serving import Server
from specdeploy.runtime import load
from specdeploy.runtime.grammar import Grammar, GrammarCompiler, GrammarError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "colour", "count"],
          "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
RF = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
PROMPTS = ['{"ok": true, "colour": "red", "count": 3} {"ok": false, "colour": "blue", "count": 1}',
           "Pick a colour and say whether it is ok.",
           '{"ok": true, "colour": "green", "count": 7}']


def test_constrained_output_matches_its_schema_and_speculation_keeps_it(tiny_bundle):
    kw = {"max_new_tokens": 48, "response_format": RF}
    with load(tiny_bundle, draft=None) as plain:
        want = [plain.generate(p, **kw) for p in PROMPTS]
        regex = plain.generate("x", max_new_tokens=12, regex="[a-c]{2,5}")
    for w in want:  # the random model's answers, and still the schema's JSON
        assert w.finish_reason == "stop" and w.stats.steps == w.stats.new_tokens - 1, w.text  # plain: one per step
        obj = json.loads(w.text)
        assert obj["colour"] in ("red", "green", "blue") and isinstance(obj["ok"], bool) and 0 <= obj["count"] <= 9
    assert 2 <= len(regex.text) <= 5 and set(regex.text) <= set("abc"), regex.text
    for draft, max_batch in (("prompt-lookup", 1), ("suffix", 1), ("auto", 1), ("prompt-lookup", 4), ("auto", 4)):
        with load(tiny_bundle, draft=draft, max_batch=max_batch) as spec:
            got = concurrently(spec, PROMPTS, **kw) if max_batch > 1 else [spec.generate(p, **kw) for p in PROMPTS]
        assert [g.token_ids for g in got] == [w.token_ids for w in want], (draft, max_batch)
        # the grammar's forced tokens (keys, quotes, braces) were drafted and accepted
        assert sum(g.stats.new_tokens for g in got) > 1.5 * sum(g.stats.steps + 1 for g in got), (draft, max_batch)


def test_sampling_under_a_constraint_is_exact(tiny_bundle):
    """5,000 two-token samples under a regular expression, with prompt-lookup and the grammar's own drafts verified
    by rejection sampling on the masked rows: their joint distribution is the masked, warped base distribution
    (chi-square, p > 0.05; :func:`~decode_checks.pairs_fit`)."""
    from specdeploy.runtime.verify import warp_logits

    warp = {"temperature": 1.5, "top_k": 5}
    prompt, regex = "a b c a b c a b c a b c", "( [abc])+"  # each token " a", " b" or " c": lookup's drafts fit
    with load(tiny_bundle, draft="prompt-lookup") as eng:
        compiled = GrammarCompiler(tiny_bundle / eng.manifest.tokenizer.file, eng.manifest.model.vocab_size,
                                   eng.manifest.model.eos_token_ids).compile(Grammar("regex", regex))
        ids = eng.encode(prompt)

        def probs(emitted: list[int]):  # the masked, warped base distribution after ``emitted``
            c = compiled.start()
            c.advance(emitted)
            logits = eng.decoder.prefill(ids + emitted)[0].root_logits
            return warp_logits(np.where(c.allowed(), logits, -np.inf), **warp)

        first = probs([])
        expected = {(a, b): first[a] * p for a in np.flatnonzero(first) for b, p in enumerate(probs([int(a)])) if p}
        runs: list = []

        def draw(n: int) -> list[tuple[int, ...]]:
            # three tokens, so that the step after the prefill verifies a draft (lookup's or the grammar's) for the
            # second
            batch = [eng.generate(prompt, max_new_tokens=3, regex=regex, **warp) for _ in range(n)]
            runs.extend(batch)
            return [tuple(r.token_ids[:2]) for r in batch]

        assert len(expected) >= 9
        p = pairs_fit(draw, expected)
    assert sum(max(r.stats.accepted, default=1) > 1 for r in runs) > len(runs) // 25  # drafts were accepted, often
    assert p > 0.05, p


def test_a_bad_constraint_is_one_sentence(tiny_bundle):
    with load(tiny_bundle, draft=None) as eng:
        for kw in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                   {"response_format": {"type": "xml"}}, {"regex": "(unclosed"}, {"grammar": "start: nothing_here"},
                   {"regex": "a", "grammar": 'start: "a"'}):
            with pytest.raises(GrammarError) as err:
                eng.generate("hi", max_new_tokens=4, **kw)
            assert str(err.value).endswith(".") and "\n" not in str(err.value), (kw, str(err.value))
        assert eng.generate("hi", max_new_tokens=4, response_format={"type": "text"}).token_ids  # no constraint


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    srv = Server(tiny_bundle, tmp_path_factory.mktemp("serve_grammar") / "server.log")  # defaults: auto, batching
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log()[-3000:]


def test_the_openai_sdk_parses_structured_output(server, tiny_bundle):
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel

    class Pick(BaseModel):
        ok: bool
        colour: Literal["red", "green", "blue"]

    strict = Pick.model_json_schema() | {"additionalProperties": False}  # what the SDK sends for a pydantic model
    with load(tiny_bundle, draft=None) as plain:
        want = [plain.generate(messages=[{"role": "user", "content": p}], max_new_tokens=40,
                               response_format={"type": "json_schema", "json_schema": {
                                   "name": "Pick", "schema": strict}}).text for p in PROMPTS]
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        for p, text in zip(PROMPTS, want):
            r = client.beta.chat.completions.parse(model=model, messages=[{"role": "user", "content": p}],
                                                   response_format=Pick, max_tokens=40, temperature=0)
            assert isinstance(r.choices[0].message.parsed, Pick) and r.choices[0].message.content == text
        kw = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 40,
              "temperature": 0, "response_format": RF}
        whole = client.chat.completions.create(**kw).choices[0].message.content
        chunks = client.chat.completions.create(stream=True, **kw)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
        assert json.loads(whole)["colour"] in ("red", "green", "blue")
        anything = client.chat.completions.create(**(kw | {"response_format": {"type": "json_object"}}))
        assert anything.choices[0].message.content.startswith("{")  # a JSON object, as far as 40 tokens go
    url = server.url + "/v1/chat/completions"
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for bad, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                    "schema": {"type": 7}}}},
                        "response_format"),
                       ({"guided_regex": "(("}, "guided_regex"), ({"response_format": {"type": "yaml"}},
                                                                  "response_format")):
        r = httpx.post(url, json=base | bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
        assert r.json()["error"]["message"].endswith("."), r.text
    r = httpx.post(url, json=base | {"guided_regex": "[0-9]{3}", "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 3, r.text


def test_a_draft_that_stops_where_the_grammar_forces_tokens_gets_them(tiny_bundle):
    """The grammar as a draft source beside another one: the tokens it forces after a draft's end are appended (a
    value copied by lookup, then the next key), within the budget; a refused token cuts the draft first."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    with load(tiny_bundle, draft=None) as eng:
        codec, m = eng.codec, eng.manifest
    c = GrammarCompiler(tiny_bundle / m.tokenizer.file, m.model.vocab_size, m.model.eos_token_ids) \
        .compile(Grammar("json_schema", schema)).start()
    opening = c.forced()
    assert codec.decode(opening).startswith('{"name')  # as tokens: what cannot merge with the value that follows
    draft, certain = c.chain([], 16)  # the forced text as tokens, the forced tokens first (certain)
    assert codec.decode(draft) == '{"name":"' and draft[:certain] == opening and certain == len(opening)
    assert c.chain([], 2) == (opening[:1], 1)
    c.advance(codec.encode('{"name":"', add_special_tokens=False))
    value = codec.encode('Ann"', add_special_tokens=False)
    chain, certain = c.chain(value, 16)
    assert certain == 0 and chain[: len(value)] == value and codec.decode(chain[len(value):]).startswith(',"age')
    assert c.chain(value, len(value) + 2) == (chain[: len(value) + 1], 0)  # the budget counts the root
    refused = value + codec.encode("}", add_special_tokens=False)  # "age" is required: the brace is refused
    assert c.chain(refused, 16) == (chain, 0)
    assert c.valid_prefix(chain) == len(chain)  # nothing of the look-ahead is left in the state


def test_a_tree_draft_is_pruned_to_the_paths_the_grammar_takes_and_masked_along_each(tiny_bundle):
    """Trees under a constraint (one generation alone): nodes the grammar refuses go with their subtrees, and each
    node's row is masked with the grammar's state after its own path, as a chain of that path would be."""
    from specdeploy.runtime.tree import DraftTree

    with load(tiny_bundle, draft=None) as eng:
        codec, m = eng.codec, eng.manifest
    compiler = GrammarCompiler(tiny_bundle / m.tokenizer.file, m.model.vocab_size, m.model.eos_token_ids)
    a, b, c, d, x = (codec.encode(ch, add_special_tokens=False)[0] for ch in "abcdx")
    root = 0
    #        0     1  2  3  4  5  6
    tokens = [root, a, x, b, x, d, c]
    parents = [-1, 0, 0, 1, 1, 3, 0]
    con = compiler.compile(Grammar("regex", "[ac][bc]d*")).start()
    assert con.forced() == []
    assert con.tree_valid(tokens, parents).tolist() == [True, True, False, True, False, True, True]
    pruned, certain = con.draft(DraftTree(tokens, parents), 16)
    assert certain == 0 and pruned.tokens.tolist() == [root, a, b, d, c]
    assert pruned.parents.tolist() == [-1, 0, 1, 2, 0]
    logits = np.random.default_rng(0).standard_normal((5, m.model.vocab_size)).astype(np.float32)
    rows = con.mask(pruned.tokens.tolist(), logits, pruned.parents)
    chain = con.mask([root, a, b, d], logits[:4])  # the path root -> a -> b -> d, as a chain
    assert np.array_equal(rows[:4], chain)
    assert np.array_equal(rows[4], con.mask([root, c], logits[[0, 4]])[1])  # c's row: after "c"
    whole = DraftTree([root, a, c], [-1, 0, 0])  # every node taken: the drafter's own tree, untouched
    assert con.draft(whole, 16)[0] is whole
    forcing = compiler.compile(Grammar("regex", "a[bc]d*")).start()  # "a" is forced: a chain with it
    assert forcing.draft(DraftTree(tokens, parents), 16)[0].tokens.tolist()[:2] == [root, a]
    assert con.valid_prefix([a, b, d]) == 3  # nothing of the walks is left in the state
