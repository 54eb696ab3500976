"""The draft tests' tiny training setup (``tiny_training.py``): a cache, a trained Chimera and its bundle,
each made once per test run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_setup(tiny_model_factory, tmp_path_factory):
    """(the tiny Llama as loaded, a 10-sequence training cache of it), shared by the Chimera and heads tests."""
    from specdeploy.exporter.source import load_model
    from specdeploy.exporter.train.data import build_cache
    from tiny_training import TINY_DATA

    loaded = load_model(str(tiny_model_factory("llama")))
    cache = build_cache(loaded, tmp_path_factory.mktemp("tiny_train_data") / "data", TINY_DATA, show_progress=False)
    return loaded, cache


@pytest.fixture(scope="session")
def tiny_draft(tiny_setup, tmp_path_factory):
    """``tiny_draft(kind)``: the weights of a tiny draft of ``kind`` trained on ``tiny_setup``, once per run
    (``tiny_training.tiny_draft_task`` says how)."""
    from specdeploy.exporter.train.weights import train
    from tiny_training import tiny_draft_task

    made = {}

    def make(kind: str):
        if kind not in made:
            out = tmp_path_factory.mktemp(f"tiny_{kind}") / f"{kind}.safetensors"
            task, loop = tiny_draft_task(tiny_setup, kind)
            train(task, out, loop, show_progress=False, log=lambda m: None)
            made[kind] = out
        return made[kind]

    return make


@pytest.fixture(scope="session")
def chimera_weights(tiny_draft):
    """The tiny Chimera's weights."""
    return tiny_draft("chimera")


@pytest.fixture(scope="session")
def chimera_bundle(tiny_bundle_factory, chimera_weights, tmp_path_factory):
    """A copy of the tiny Llama bundle with that Chimera exported into it."""
    import shutil

    from specdeploy.exporter.export.draft import export_draft

    bundle = tmp_path_factory.mktemp("chimera_bundle") / "b"
    shutil.copytree(tiny_bundle_factory("llama"), bundle)
    export_draft(bundle, "chimera", chimera_weights, progress=lambda m: None)
    return bundle
