"""DSpark's sequential stage over the DFlash backbone, on the device.

After :func:`.model.block_hidden` (one parallel pass over each request's query
block), the Markov head drafts left to right exactly as vLLM 0.33's
``DSparkSpeculator._sample_sequential`` does:

    base = lm_head(h) * logit_scale                      (draft vocabulary, [R, k, dV])
    prev = anchor                                        (a target id)
    for i in 0..k-1:
        e_i = markov_w1[prev]                            ([R, r])
        logits_i = base[:, i] + markov_w2(e_i) * logit_scale
        draft_i = map_draft_to_target(pick(logits_i)); prev = draft_i
    confidence = sigmoid(proj([h_i | e_i]))              (float32; [h_i] without the Markov input)

``pick`` is the argmax (greedy drafting), or, when the batch carries temperatures and
seeds (vLLM's ``draft_sample_method: probabilistic``), the seeded Gumbel-max sample of
:mod:`.gumbel` keyed as vLLM keys draft ``i`` (argmax where a request's temperature is 0).
With ``dspark_draft_topk`` the bias is added only to the top-k base logits (every other
entry -inf), as ``_sample_sequential_topk`` does. No host synchronisation: the loop is
capturable in a CUDA graph.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .dspark_config import DSparkConfig
from .dspark_weights import DSparkHeads
from .model import BlockBatch, FusedWeights, block_hidden


def to_target(fw: FusedWeights, ids: torch.Tensor) -> torch.Tensor:
    """``map_draft_to_target``: draft ids + d2t (identity for a full-vocabulary draft)."""
    return ids if fw.d2t is None else ids + fw.d2t[ids]


def dspark_drafts(fw: FusedWeights, heads: DSparkHeads, ops: Any, kv: torch.Tensor, batch: BlockBatch,
                  splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target ids ``[R, k]`` int64 (greedy, or sampled when ``batch.temperature`` is set) and,
    with a confidence head, their float32 confidence ``[R, k]`` (else None)."""
    cfg: DSparkConfig = fw.config
    r, k, scale = batch.anchors.shape[0], batch.k, cfg.logit_scale
    h = block_hidden(fw, ops, kv, batch, splits)                        # [R*k, H], (request, step)
    base = F.linear(h, fw.lm_head)
    if scale != 1.0:
        base = base * scale
    base = base.view(r, k, -1)
    anchors = batch.anchors
    if cfg.draft_topk is None:          # the bias GEMM, the sum and the pick: one pass a step (Triton)
        ids = ops.markov_drafts(base, anchors, heads.markov_w1, heads.markov_w2, scale, fw.d2t,
                                batch.temperature, batch.seeds, batch.ctx_lens, heads.target_ids)
    else:
        ids = _topk_drafts(fw, heads, ops, base, anchors.long(), batch, cfg.draft_topk, scale)
    if heads.confidence_w is None:
        return ids, None
    w1 = heads.markov_w1 if cfg.confidence_with_markov else None
    return ids, ops.markov_confidence(h, anchors, ids.contiguous(), w1, heads.confidence_w, heads.confidence_b)


def _topk_drafts(fw: FusedWeights, heads: DSparkHeads, ops: Any, base: torch.Tensor, prev: torch.Tensor,
                 batch: BlockBatch, topk: int, scale: float) -> torch.Tensor:
    """``_sample_sequential_topk``: the bias added to the top-k base logits only."""
    values, index = base.topk(topk, dim=-1)
    dense = torch.full_like(base[:, 0], float("-inf"))
    drafts = []
    for i in range(base.shape[1]):
        e = F.embedding(prev, heads.markov_w1)                          # [R, r]
        w = heads.markov_w2[index[:, i]]                                # [R, topk, r]
        corrected = values[:, i].unsqueeze(-1).clone()
        corrected.baddbmm_(w, e.unsqueeze(-1), beta=1.0, alpha=scale)
        logits = dense.fill_(float("-inf")).scatter(1, index[:, i], corrected.squeeze(-1))
        pick = ops.argmax(logits) if batch.temperature is None else ops.gumbel_argmax(
            logits, batch.temperature, batch.seeds, batch.ctx_lens, i, heads.target_ids)
        prev = to_target(fw, pick.view(-1))
        drafts.append(prev)
    return torch.stack(drafts, dim=1)
