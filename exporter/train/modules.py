"""Draft modules rebuilt from a weights file (for export, validation and evaluation), every key checked."""

from __future__ import annotations

from specdeploy.exporter.train.weights import DraftWeights, load_checked_state


def heads_from_weights(weights: DraftWeights):
    """Rebuild the heads module from a weights file, every key and shape checked."""
    from specdeploy.graphs.build import build_heads

    return load_checked_state(build_heads(weights.config), weights.prefixed("heads."), weights,
                              f"a {weights.config.kind} draft with {weights.config.num_heads} heads")


def chimera_from_weights(weights: DraftWeights):
    """Rebuild the fp32 Chimera draft from a weights file, every key and shape checked."""
    import torch
    from specdeploy.graphs.chimera import ChimeraDraft

    state = {k: v.to(torch.float32) for k, v in weights.prefixed("chimera.").items()}
    return load_checked_state(ChimeraDraft(weights.config), state, weights,
                              f"a Chimera draft with {weights.config.num_heads} heads")
