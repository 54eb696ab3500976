"""Drafts in torch, on the base's device: the ``graphs/`` draft modules behind the runtime's drafters.

The runtime's drafters run their draft graphs in ONNX Runtime on the CPU. Beside a base on a GPU that
would make every draft call a CPU call, so here the same modules that export traces run in torch on the
torch backend's device and precision, behind the runtime's own drafter logic (catch-up, chains, adaptive
depth, trees, Cerberus' gate):

* :class:`TorchChimeraDrafter`: the Chimera drafter with its step module and draft cache on the device;
* :class:`TorchSession`: the one call of an ONNX Runtime session the heads drafters make (``run``), over
  the Medusa/Cerberus heads module and Cerberus' gate.

:func:`bundle_drafter` builds them for a bundle's draft (``TorchBackend.make_drafter``), from the weights
file the draft was exported from, over the base weights the backend holds; :func:`load_chimera` and
:func:`random_chimera` build a Chimera from a weights file or at random (the GPU check's timings).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from specdeploy.graphs.chimera import ChimeraConfig, ChimeraDraft, ChimeraStepGraph
from specdeploy.runtime.drafters.chimera import ChimeraDrafter
from specdeploy.runtime.drafters.kinds import CHIMERA
from specdeploy.runtime.errors import DraftMismatchError
from specdeploy.runtime.tree import TreeSpec
from specdeploy.runtime.tree_table import parse_tree_arg

DEFAULT_TOPK = 10


class TorchChimeraDrafter(ChimeraDrafter):
    """ChimeraDrafter whose draft step and draft cache live on ``device`` in ``dtype``."""

    def __init__(self, graph: ChimeraStepGraph, device: torch.device | str, dtype: torch.dtype,
                 tree: TreeSpec | None = None, topk: int = DEFAULT_TOPK, dynamic_nodes: int | None = None):
        cfg = graph.draft.config
        self.device, self.dtype = torch.device(device), dtype
        self.graph = graph.to(self.device, dtype).eval()
        if tree is None and dynamic_nodes is None:
            tree = parse_tree_arg(f"chain{cfg.num_heads}")
        super().__init__(None, cfg.num_heads, cfg.num_key_value_heads, cfg.head_dim, topk, tree, dynamic_nodes,
                         feature_layers=cfg.feature_layers)
        self._neg_t = torch.finfo(dtype).min
        self.calls = 0

    def _grow(self, shape: tuple[int, ...], cap: int) -> None:
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        if self._k is not None:
            k[:, :, :cap] = self._k
            v[:, :, :cap] = self._v
        self._k, self._v = k, v

    def _run(self, hidden: np.ndarray, trigrams: np.ndarray, start: int, base_hidden: np.ndarray, head: int,
             layers: np.ndarray | None = None):
        t = hidden.shape[0]
        self._ensure(start + t)
        cap = self._k.shape[2]
        dev, dt = self.device, self.dtype
        t0 = time.perf_counter()
        mask = torch.full((1, 1, t, cap), self._neg_t, device=dev, dtype=dt)
        mask[..., :start] = 0.0
        causal = torch.ones((t, t), dtype=torch.bool, device=dev).tril()
        mask[0, 0, :, start:start + t] = torch.where(causal, 0.0, self._neg_t).to(dt)
        slots = torch.arange(start, start + t, device=dev)
        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(hidden, np.float32)).to(dev, dt)[None]
            if layers is not None:  # a fusing draft's real slots read the tapped base layers (its chain slots: hidden)
                x = self.graph.draft.fusion(torch.from_numpy(np.ascontiguousarray(layers, np.float32)).to(dev, dt)[None])
            feat, ids, logp, self._k, self._v = self.graph.step(
                x,
                torch.from_numpy(np.ascontiguousarray(trigrams, np.int64)).to(dev)[None], slots[None], mask, slots,
                torch.from_numpy(np.ascontiguousarray(base_hidden, np.float32)).to(dev, dt)[None],
                torch.tensor([head], device=dev), self._k, self._v)
            out = feat[0].float().cpu().numpy(), ids[0].cpu().numpy(), logp[0].float().cpu().numpy()  # syncs
        self.calls += 1
        if self.policy is not None:
            self.policy.timer.timed(time.perf_counter() - t0, rows=t)
        return out


def chimera_step_graph(draft: ChimeraDraft, embed_weight: torch.Tensor, lm_weight: torch.Tensor,
                       topk: int = DEFAULT_TOPK) -> ChimeraStepGraph:
    """The draft step over the base's embedding ``[V, H]`` and lm_head ``[V, H]`` (no vocabulary trim)."""
    cfg = draft.config
    if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftMismatchError(
            f"The Chimera draft is for a base of hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size}, "
            f"not {embed_weight.shape[1]} and {embed_weight.shape[0]}.")
    return ChimeraStepGraph(draft, embed_weight, lm_weight, topk).eval()


def load_chimera(path, embed_weight: torch.Tensor, lm_weight: torch.Tensor, device, dtype,
                 tree: TreeSpec | None = None, topk: int = DEFAULT_TOPK) -> TorchChimeraDrafter:
    """A trained draft (``train chimera`` output) over the base's embedding and lm_head, with the vocabulary
    trim it was trained with: the step module ``export draft`` traces."""
    from specdeploy.exporter.export.draft import chimera_graph_module
    from specdeploy.exporter.train.weights import load_draft_weights

    weights = load_draft_weights(path, CHIMERA)
    cfg = weights.config
    if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftMismatchError(
            f"The Chimera draft is for a base of hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size}, "
            f"not {embed_weight.shape[1]} and {embed_weight.shape[0]}.")
    graph = chimera_graph_module(weights, embed_weight, lm_weight, topk, weights.vocab_trim)
    return TorchChimeraDrafter(graph, device, dtype, tree, topk)


def random_chimera(config: ChimeraConfig, embed_weight: torch.Tensor, lm_weight: torch.Tensor, device, dtype,
                   seed: int = 0, tree: TreeSpec | None = None) -> TorchChimeraDrafter:
    """A randomly initialised draft of ``config``'s shape (for timings and the CPU dry run)."""
    torch.manual_seed(seed)
    return TorchChimeraDrafter(chimera_step_graph(ChimeraDraft(config), embed_weight, lm_weight), device, dtype, tree)


class TorchSession:
    """``run(None, feeds)`` of an ONNX Runtime session, over a torch module on ``device`` in ``dtype``."""

    def __init__(self, module: torch.nn.Module, inputs: tuple[str, ...], device, dtype: torch.dtype):
        self.module, self.inputs = module.to(device, dtype).eval(), inputs
        self.device, self.dtype = torch.device(device), dtype

    def run(self, names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        args = []
        for name in self.inputs:
            x = torch.from_numpy(np.ascontiguousarray(feeds[name])).to(self.device)
            args.append(x.to(self.dtype) if x.is_floating_point() else x)
        with torch.no_grad():
            outs = self.module(*args)
        return [o.float().cpu().numpy() if o.is_floating_point() else o.cpu().numpy() for o in outs]


def bundle_drafter(name: str, manifest, embed_weight: torch.Tensor, lm_weight: torch.Tensor, device,
                   dtype: torch.dtype, tree: str | None, chains: bool):
    """The bundle's trained draft ``name`` (chimera, medusa, cerberus, cerberus-nogate) in torch on ``device``,
    by the ``torch_maker`` its kind's description names."""
    from specdeploy.runtime.drafters.kinds import describe, resolve

    return resolve(describe(name).torch_maker)(name, manifest, embed_weight, lm_weight, device, dtype, tree, chains)


def _entry_tree(name: str, manifest, tree: str | None, chains: bool):
    """(description, entry, num_heads, topk, spec, dynamic) of the bundle draft that ``name`` runs."""
    from specdeploy.runtime.drafters.heads import check_entry, resolve_tree
    from specdeploy.runtime.drafters.kinds import describe

    desc = describe(name)
    entry = manifest.draft(desc.bundle_kind)
    check_entry(entry, manifest)
    num_heads, topk = int(entry.setting("num_heads")), int(entry.setting("topk"))
    return (desc, entry, num_heads, topk, *resolve_tree(tree, entry, manifest, num_heads, chains))


def chimera_bundle_drafter(name: str, manifest, embed_weight: torch.Tensor, lm_weight: torch.Tensor, device,
                           dtype: torch.dtype, tree: str | None, chains: bool) -> TorchChimeraDrafter:
    from specdeploy.exporter.export.draft import torch_draft_modules
    from specdeploy.runtime.draft_contract import CHIMERA_STEP

    desc, entry, _, topk, spec, dynamic = _entry_tree(name, manifest, tree, chains)
    module = torch_draft_modules(entry, lm_weight, embed_weight)[desc.role(CHIMERA_STEP).role]
    return TorchChimeraDrafter(module, device, dtype, spec, topk, dynamic)


def heads_bundle_drafter(name: str, manifest, embed_weight: torch.Tensor, lm_weight: torch.Tensor, device,
                         dtype: torch.dtype, tree: str | None, chains: bool):
    from specdeploy.exporter.export.draft import torch_draft_modules
    from specdeploy.runtime.draft_contract import GATE, HEADS
    from specdeploy.runtime.drafters.heads import HeadsDrafter, gate_from_entry

    desc, entry, num_heads, topk, spec, dynamic = _entry_tree(name, manifest, tree, chains)
    modules = torch_draft_modules(entry, lm_weight, embed_weight)
    gate = gate_from_entry(entry) if desc.gated else None
    gate_session = (TorchSession(modules[desc.gate_role.role], GATE.input_names(), device, dtype)
                    if gate else None)
    heads = TorchSession(modules[desc.role(HEADS).role], HEADS.input_names(), device, dtype)
    return HeadsDrafter(entry.kind, heads, num_heads, topk, spec, dynamic, gate, gate_session)
