"""DSparkEngine: DSpark drafting on the DFlash engine (one engine family).

Everything of :class:`~.engine.DFlashEngine` is shared — the paged K/V pool and
its block tables (rewind, fork, release), batched ingest (the context
projection is the backbone's), the batched query pass, CUDA graphs per batch
bucket and device-side greedy drafting. DSpark changes the propose step only:
the query block follows the checkpoint's layout (``sample_from_anchor``: ``k``
rows from the anchor, else DFlash's ``1 + k``) and the drafts come from the
sequential Markov head (:mod:`.dspark_model`), with per-draft confidence when
the checkpoint has a confidence head (sent back in the reply as ``confidence``).

Drafts are greedy, as vLLM drafts with ``draft_sample_method`` greedy, or, for the
requests of a batch that carry a temperature and a seed, sampled as vLLM 0.33 samples
them with ``probabilistic`` (:mod:`.gumbel`: the same draws for the same seed). Draft
logits are not offered (the Markov head makes each position's distribution depend on the
drafted prefix).
"""
from __future__ import annotations

from typing import Any

import torch

from ..base import EngineCaps, Proposal, ProposeBatch
from .dspark_config import SIGNATURE_KEYS, DSparkConfig
from .dspark_model import dspark_drafts
from .dspark_weights import DSparkHeads, load_dspark
from .engine import DFlashEngine, _dtype
from .model import BlockBatch
from .weights import DFlashWeights


class DSparkEngine(DFlashEngine):
    """DSpark block drafter over a DSpark checkpoint and its target's embed/lm_head
    (options: :meth:`DFlashEngine._build`)."""

    def __init__(self, draft_dir: str, target_dir: str, device: str = "cpu",
                 dtype: str | None = None, **options: Any):
        dev = torch.device(device)
        weights, self.heads = load_dspark(draft_dir, target_dir, _dtype(dtype, dev), dev)
        self._build(weights, **options)

    @classmethod
    def from_weights(cls, weights: DFlashWeights, heads: DSparkHeads | None = None,
                     **options: Any) -> "DSparkEngine":
        if heads is None:
            raise ValueError("a DSpark engine needs its Markov (and confidence) heads")
        engine = cls.__new__(cls)
        engine.heads = heads
        engine._build(weights, **options)
        return engine

    def _build(self, weights: DFlashWeights, **options: Any) -> None:
        if weights.d2t is not None:            # the Gumbel noise is keyed by target ids
            self.heads.target_ids = torch.arange(weights.d2t.shape[0], device=weights.device) + \
                weights.d2t.to(weights.device, torch.int64)
        super()._build(weights, **options)

    def _caps(self, block_size: int, max_spec_tokens: int | None) -> EngineCaps:
        cfg: DSparkConfig = self.config
        limit = cfg.max_k
        signature = {"sample_from_anchor": cfg.sample_from_anchor, "draft_vocab_size": cfg.draft_vocab_size,
                     "markov_rank": cfg.markov_rank, "draft_topk": cfg.draft_topk}
        assert tuple(signature) == SIGNATURE_KEYS
        return EngineCaps(
            kind="dspark", needs_hidden_states=True, context_width=cfg.context_width,
            max_spec_tokens=limit if max_spec_tokens is None else min(max_spec_tokens, limit),
            block_size=block_size, vocab_size=cfg.vocab_size, hidden_size=cfg.target_hidden_size,
            mask_token_id=cfg.mask_token_id, aux_layer_ids=tuple(cfg.target_layer_ids),
            draft=signature, confidence=self.heads.confidence_w is not None, sampling=True)

    def _workspace_bytes(self, max_batch: int) -> int:
        cfg = self.config
        markov = max_batch * cfg.draft_vocab_size * 8 * torch.empty((), dtype=self.dtype).element_size()
        return super()._workspace_bytes(max_batch) + markov

    def device_batch(self, buf: torch.Tensor, rows: int, width: int, k: int) -> BlockBatch:
        batch = DFlashEngine.device_batch(buf, rows, width, k)
        batch.from_anchor = self.config.sample_from_anchor
        return batch

    def forward(self, batch: BlockBatch) -> torch.Tensor:
        raise NotImplementedError("DSpark drafts through its Markov head: use drafts()")

    def drafts(self, batch: BlockBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy target ids ``[R, k]`` and their confidence (or None), on the device."""
        return dspark_drafts(self.weights, self.heads, self.ops, self.cache.kv, batch,
                             self._splits(batch.anchors.shape[0]))

    def _propose_eager(self, anchors: torch.Tensor, batch: ProposeBatch) -> Proposal:
        r, k = len(batch.states), batch.k
        width = max(1, max(len(s.blocks) for s in batch.states))
        buf = self.host_inputs(anchors, batch.states, r, width).to(self.device, non_blocking=True)
        block = self.device_batch(buf, r, width, k)
        if batch.sampled:
            block.temperature = batch.temperature.to(self.device, torch.float32, non_blocking=True)
            block.seeds = batch.seeds.to(self.device, torch.int64, non_blocking=True)
        ids, conf = self.drafts(block)
        return Proposal(ids.cpu(), confidence=None if conf is None else conf.cpu())

    def _empty(self, r: int, k: int, batch: ProposeBatch) -> Proposal:
        out = super()._empty(r, k, batch)
        if self.caps.confidence:
            out.confidence = torch.zeros(r, k)
        return out
