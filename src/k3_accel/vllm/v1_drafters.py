"""Remote drafters for the V1 model runner (imported only once vLLM's runner is).

:class:`RemoteDFlashProposer` subclasses vLLM's ``DFlashProposer`` so every
``isinstance`` check in the runner still holds, but it loads no draft model,
owns no draft KV cache and never runs a draft forward: ``propose`` ships the
step's valid context rows (aux hidden states concatenated) to the draft
server and returns its drafts. Dummy/profile runs never touch the network.
(``method: "ngram"`` lives in :mod:`k3_accel.vllm.v1_ngram`: it imports numba.)
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from k3_accel.vllm.remote import RemoteDraftSession
from k3_accel.vllm.v1_inputs import DraftBatch, KnownRequests, dflash_step, needs_no_drafts, scatter_drafts

log = logging.getLogger("k3_accel.vllm")


class _Remote:
    """What both remote drafters share: the session, the request book, the skip rule."""
    is_remote_drafter = True
    session: RemoteDraftSession | None = None
    runner: Any = None

    def _open(self, vllm_config: Any, device: torch.device) -> None:
        if self.session is None:
            self.session = RemoteDraftSession(vllm_config, device)

    def _live_requests(self, num_reqs: int) -> tuple[list[str], list[int]]:
        """Ids of the batch's first ``num_reqs`` rows and the rows that may want drafts.

        Frees requests that left the runner since the last call.
        """
        runner = self.runner
        gone = self.known.departed(runner.requests)
        if gone and self.session is not None:
            self.session.finish(gone)
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        keep = [i for i, rid in enumerate(req_ids) if not needs_no_drafts(runner.requests[rid].sampling_params)]
        return req_ids, keep

    def stats(self) -> dict:
        return self.session.stats() if self.session is not None else {}

    def close(self) -> None:
        """Drop the connection (idempotent); the drafter drafts no more."""
        if self.session is not None:
            self.session.close()
            self.session = None


class RemoteDFlashProposer(_Remote, DFlashProposer):
    """``method: "dflash"`` with the draft model in a ``k3-draft-server``."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.known = KnownRequests()
        self.supports_mm_inputs = False       # no local draft model to feed embeddings to
        self.hidden_states = None             # draft-model input buffers: never used remotely
        self.inputs_embeds = None

    def load_model(self, target_model: Any) -> None:
        """No draft weights on the target: connect to the draft server instead."""
        self._open(self.vllm_config, self.device)

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        return None

    def initialize_attn_backend(self, kv_cache_config: Any, kernel_block_sizes: Any = None) -> None:
        # no draft layers: borrow the target's first KV group so the runner hands
        # ``propose`` that group's attention metadata
        self.kv_cache_gid = 0
        self.draft_attn_groups = []
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    def validate_same_kv_cache_group(self, kv_cache_config: Any) -> None:
        return None

    def propose(self, num_speculative_tokens: int, target_token_ids: torch.Tensor,
                target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                next_token_ids: torch.Tensor, token_indices_to_sample: Any, common_attn_metadata: Any,
                sampling_metadata: Any = None, mm_embed_inputs: Any = None,
                num_rejected_tokens_gpu: torch.Tensor | None = None, slot_mappings: Any = None) -> torch.Tensor:
        k = int(num_speculative_tokens)
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        req_ids, keep = self._live_requests(min(batch_size, self.runner.input_batch.num_reqs))
        if self.session is None or not keep:
            return torch.full((batch_size, k), -1, dtype=torch.int64, device=self.device)
        inp = None
        if self.session.is_driver:
            inp = self._step_input(req_ids, keep, k, common_attn_metadata, num_rejected_tokens_gpu,
                                   target_token_ids, target_positions, target_hidden_states, next_token_ids)
        drafts = self.session.step(inp, len(keep), k)
        return scatter_drafts(drafts, keep, batch_size, k)

    def _step_input(self, req_ids, keep, k, cad, num_rejected, token_ids, positions, hidden, next_token_ids):
        try:
            batch = DraftBatch.from_runner(req_ids, cad.query_start_loc_cpu, num_rejected,
                                           self.runner.discard_request_mask.np)
            fresh = self.known.new(req_ids[i] for i in keep)
            prompts = {rid: self.runner.requests[rid].prompt_token_ids for rid in fresh}
            return dflash_step(batch, keep, token_ids=token_ids, positions=positions,
                               hidden=hidden if self.session.ships_hidden else None,
                               next_token_ids=next_token_ids, k=k, prompts=prompts)
        except Exception:
            log.exception("k3-accel: cannot build the remote draft step; no drafts this step")
            return None
