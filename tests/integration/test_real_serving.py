"""The real SmolLM2 bundle batched, behind `specdeploy serve` and behind `serve --ray`: answers equal alone."""

from __future__ import annotations

import os

import numpy as np
import pytest
from decode_checks import concurrently
from serving import RayServer, Server
from specdeploy.runtime import load


@pytest.mark.slow
def test_real_model_batched_equals_alone(real_bundle):
    """The real SmolLM2 bundle: four chat prompts batched, with and without prompt lookup, equal alone."""
    msgs = [[{"role": "user", "content": c}] for c in
            ("Name three prime numbers.", "Write a haiku about CPUs.", "List the days of the week.",
             "Repeat: the cat sat on the mat, the cat sat on the mat.")]
    for draft in (None, "prompt-lookup"):
        with load(real_bundle, draft=draft, max_batch=4, threads=2) as eng:
            alone = [eng.generate(messages=m, max_new_tokens=32) for m in msgs]
            batched = concurrently(eng, [None] * len(msgs), messages_list=msgs, max_new_tokens=32)
        assert [a.token_ids for a in alone] == [b.token_ids for b in batched]
        assert all(np.isfinite(a.stats.tokens_per_s) for a in alone)


@pytest.mark.slow
def test_real_model_chat_through_openai_client(real_bundle, tmp_path):
    from openai import OpenAI

    srv = Server(real_bundle, tmp_path / "server.log", "--draft", "prompt-lookup")
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            model = client.models.list().data[0].id
            messages = [{"role": "user", "content": "Name three prime numbers."}]
            out = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
            _structured_clients(client, model)
        text = out.choices[0].message.content
        with load(real_bundle, draft="prompt-lookup", max_batch=16) as eng:  # as the server runs it
            assert text == eng.generate(messages=messages, max_new_tokens=32).text
        assert text.strip() and out.choices[0].finish_reason in ("stop", "length")
    finally:
        srv.stop()
    assert os.path.exists(srv.log_path)


def _structured_clients(client, model: str) -> None:
    """The OpenAI SDK's parse() and instructor (its default tools mode), unchanged, get validated objects."""
    import instructor
    from pydantic import BaseModel, ConfigDict, Field

    class Person(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=130)

    msgs = [{"role": "user", "content": "Extract the person: Maria Lopez, 34, moved to Valencia last spring."}]
    parsed = client.chat.completions.parse(model=model, messages=msgs, response_format=Person, max_tokens=64,
                                           temperature=0).choices[0].message.parsed
    assert isinstance(parsed, Person) and "Maria" in parsed.name, parsed
    person = instructor.from_openai(client).chat.completions.create(
        model=model, messages=msgs, response_model=Person, max_tokens=96, temperature=0, max_retries=0)
    assert isinstance(person, Person), person


@pytest.mark.slow
def test_real_model_replicas_answer_as_the_engine_does(real_bundle, tmp_path):
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'specdeploy[ray]')")
    from specdeploy.runtime import load

    messages = [{"role": "user", "content": "Name three prime numbers."}]
    srv = RayServer(real_bundle, tmp_path / "serve.log", "--replicas", "2", "--max-batch", "4", "--model-name", "m")
    try:
        answers = {srv.client.chat.completions.create(model="m", messages=messages, max_tokens=32,
                                                      temperature=0).choices[0].message.content for _ in range(4)}
    finally:
        assert srv.stop() == 0
    with load(real_bundle, threads=1, max_batch=4, draft=None) as engine:  # a replica's engine: one core, batching
        want = engine.generate(messages=messages, max_new_tokens=32).text
    assert answers == {want}
