"""The torch engine of the self-distillation data: batched greedy replies, then a teacher-forced pass.

It runs on any torch device (``--device``); the runtime's engine is :mod:`.selfdistill`. Both feed the
same cache (:mod:`.data`).
"""

from __future__ import annotations

import numpy as np
from specdeploy.exporter.train.selfdistill import fp16_states, reply_mask


def generate_replies(model, tokenizer, prompts: list[np.ndarray], max_new_tokens: int,
                     min_tokens: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The base model's own greedy replies to ``prompts``, batched: (prompt + reply ids, reply mask).

    ``model`` may be a bf16 copy of the base, for speed: the teacher-forced fp32 pass that follows
    recomputes the labels, so where bf16 and fp32 disagree the label is still the deployed model's
    choice. A reply ends after the end-of-turn token; one shorter than ``min_tokens`` is dropped
    (returned with an all-zero mask).
    """
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.from_numpy(p.astype(np.int64))
        attn[i, width - len(p):] = 1
    device = next(model.parameters()).device
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=pad, temperature=None, top_p=None,
                         top_k=None).cpu()
    result = []
    for i, p in enumerate(prompts):
        reply = out[i, width:].numpy().astype(np.int32)
        ends = np.flatnonzero(reply == eos)
        if ends.size:
            reply = reply[: ends[0] + 1]
        result.append((np.concatenate([p, reply]).astype(np.int32), reply_mask(len(p), len(reply), min_tokens)))
    return result


def forward_shard(model, seqs: list[tuple[np.ndarray, np.ndarray]],
                  feature_layers: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """Teacher-forced base pass, one sequence at a time (no padding waste): fp16 hidden + argmax labels.

    ``feature_layers`` adds ``layers`` ``[n, L*H]`` fp16: the residual output of each listed decoder layer
    (0-based), side by side, for drafts that fuse low, mid and high features (EAGLE-3).
    """
    import torch
    from specdeploy.graphs.base_step import check_feature_layers

    feature_layers = check_feature_layers(feature_layers, int(model.config.num_hidden_layers))
    hidden, labels, layers = [], [], []
    device = next(model.parameters()).device
    for ids, _ in seqs:
        x = torch.from_numpy(ids.astype(np.int64))[None].to(device)  # [1, L]
        out = model.model(input_ids=x, output_hidden_states=bool(feature_layers))
        h = out.last_hidden_state  # [1, L, H] after the final norm
        logits = model.lm_head(h)  # [1, L, V] fp32, so labels match the deployed fp32 graph's argmax
        hidden.append(h[0].to(torch.float16).cpu().numpy())
        labels.append(logits[0].argmax(-1).to(torch.int32).cpu().numpy())
        if feature_layers:  # hidden_states[i + 1] is decoder layer i's output (index 0: the embeddings)
            taps = torch.cat([out.hidden_states[i + 1][0] for i in feature_layers], dim=-1)
            layers.append(fp16_states(taps.float().cpu().numpy()))
    arrays = {
        "tokens": np.concatenate([ids for ids, _ in seqs]).astype(np.int32),
        "assistant": np.concatenate([m for _, m in seqs]).astype(np.uint8),
        "hidden": np.concatenate(hidden),
        "labels": np.concatenate(labels),
        "lengths": np.asarray([len(ids) for ids, _ in seqs], dtype=np.int64),
    }
    if feature_layers:
        arrays["layers"] = np.concatenate(layers)
    return arrays
