"""The runtime tests' shared engine: one plain (speculation off) engine over the tiny Llama bundle."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def plain_engine(tiny_bundle):
    """Plain greedy decoding of the tiny bundle, loaded once; the reference the serving tests compare with."""
    from specdeploy.runtime import load

    with load(tiny_bundle, draft=None) as eng:
        yield eng
