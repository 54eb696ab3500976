"""What the draft tests share: a small training cache of the tiny Llama and the Chimera task over it.

``exporter/conftest.py`` makes the cache (``tiny_setup``), a tiny draft of each kind trained on it
(``tiny_draft(kind)``) and a tiny bundle with the Chimera (``chimera_bundle``) as session fixtures, so Chimera,
Medusa and Cerberus tests build them once.
"""

from __future__ import annotations

import numpy as np
from specdeploy.exporter.train.chimera import ChimeraTask, ChimeraTrainConfig
from specdeploy.exporter.train.data import DataConfig
from specdeploy.exporter.train.heads import HeadsTask, HeadsTrainConfig
from specdeploy.exporter.train.weights import LoopConfig
from specdeploy.graphs.chimera import ChimeraConfig

TINY_DATA = DataConfig(max_seqs=10, max_len=96, min_assistant_tokens=8, heldout_fraction=0.3, shard_size=5)
CHIMERA_LOOP = LoopConfig(epochs=3, batch_size=2, lr=3e-3, warmup_steps=2, ckpt_every=2, threads=2)
HEADS_LOOP = LoopConfig(epochs=2, batch_size=64, lr=3e-3, warmup_steps=2, ckpt_every=3, threads=2)
TINY_CHIMERA = ChimeraConfig("chimera", num_heads=3, hidden_size=16, vocab_size=50, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=4, intermediate_size=24, base_weight_sha="x")


def mtbench_first_turns(n: int) -> list[str]:
    """The first turns of the first ``n`` MT-bench questions (the real-model draft tests' prompts)."""
    import json

    from specdeploy.exporter.bench.run import default_prompts_file

    lines = default_prompts_file().read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:n]]


def graph_files(bundle, drafts=("chimera",)) -> list[str]:
    """The base graphs and those of ``drafts`` (each draft shares only with the base: drafts are
    replaced one at a time, so none may point into another's data)."""
    from specdeploy.runtime.bundle import read_manifest

    m = read_manifest(bundle)
    return [g.file for g in m.graphs] + [g.file for d in m.drafts if d.kind in drafts for g in d.graphs]


def chimera_task(setup, **kw) -> ChimeraTask:
    """The Chimera training task over ``setup`` (``(loaded model, cache)``), 4 heads, a 2048-id vocabulary."""
    loaded, cache = setup
    m = loaded.model
    order = np.lexsort((np.arange(m.config.vocab_size), -cache.label_counts(m.config.vocab_size)))
    cfg = ChimeraTrainConfig(**{"num_heads": 4, "vocab_trim": 2048, **kw})
    return ChimeraTask(cache, m.model.embed_tokens.weight, m.lm_head.weight, m.model.norm.weight, m.config,
                       loaded.weight_sha, cfg, order)


def heads_task(setup, kind: str, **kw) -> HeadsTask:
    """The Medusa or Cerberus training task over ``setup``."""
    loaded, cache = setup
    return HeadsTask(cache, loaded.model.lm_head.weight, loaded.weight_sha, HeadsTrainConfig(kind, **kw))


def tiny_draft_task(setup, kind: str):
    """(task, loop) of the tiny draft of ``kind`` the ``tiny_draft`` fixture trains: Chimera (4 heads, 2048 ids,
    3 epochs), Medusa (the full shared lm_head) and Cerberus (4096 ids), 2 epochs each."""
    if kind == "chimera":
        return chimera_task(setup), CHIMERA_LOOP
    return heads_task(setup, kind, vocab_trim=0 if kind == "medusa" else 4096), HEADS_LOOP
