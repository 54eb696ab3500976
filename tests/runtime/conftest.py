"""The runtime tests' shared engine (one plain engine over the tiny Llama bundle) and the batch tests' plain
answers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def plain_engine(tiny_bundle):
    """Plain greedy decoding of the tiny bundle, loaded once; the reference the serving tests compare with."""
    from specdeploy.runtime import load

    with load(tiny_bundle, draft=None) as eng:
        yield eng


@pytest.fixture(scope="module")
def alone(tiny_bundle):
    """Each of ``BATCH_PROMPTS``' greedy answers from ``generate`` on a max_batch 1 engine, plainly (300 tokens:
    past 256 columns, so a batch's shared cache grows under load, rows copied)."""
    from decode_checks import BATCH_PROMPTS
    from specdeploy.runtime import load

    with load(tiny_bundle, draft=None) as eng:
        return [eng.generate(p, max_new_tokens=300) for p in BATCH_PROMPTS]
