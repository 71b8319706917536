"""Remote drafters for the V1 model runner (imported only once vLLM's runner is).

:class:`RemoteDFlashProposer` subclasses vLLM's ``DFlashProposer`` so every
``isinstance`` check in the runner still holds, but it loads no draft model,
owns no draft KV cache and never runs a draft forward: ``propose`` ships the
step's valid context rows (aux hidden states concatenated) to the draft
server and returns its drafts, -1 where there is none (the V1 runner clamps
-1 before its embedding and the rejection sampler rejects it). Dummy/profile
runs never touch the network. (``method: "ngram"`` lives in
:mod:`.v1_ngram`: it imports numba.)
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from k3_accel.vllm.spec_decode.core import NO_LIMIT, Build, RemoteDrafter, finishes_after_prefill
from k3_accel.vllm.spec_decode.rows import BatchRows, gather_step

log = logging.getLogger("k3_accel.vllm")


def _max_tokens(request: Any) -> int:
    limit = getattr(getattr(request, "sampling_params", None), "max_tokens", None)
    return NO_LIMIT if limit is None else int(limit)


class RemoteProposerBase:
    """What both V1 drafters share: the core, the runner's request ids and skip mask."""
    is_remote_drafter = True
    runner: Any = None
    core: RemoteDrafter

    def _step(self, num_reqs: int, k: int, build: Build, pad_to: int | None = None) -> torch.Tensor:
        """Drafts for the runner's first ``num_reqs`` batch rows (see :meth:`RemoteDrafter.step`)."""
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        limits = np.fromiter((_max_tokens(runner.requests[rid]) for rid in req_ids), dtype=np.int64,
                             count=len(req_ids))
        return self.core.step(req_ids, skip=finishes_after_prefill(limits), k=k, build=build,
                              live=runner.requests, pad_to=pad_to)

    def _prompts(self, fresh: list[str]) -> dict[str, Any]:
        """Token history (prompt, then outputs) of the requests the transport may have to attach."""
        requests = self.runner.requests
        return {rid: list(requests[rid].prompt_token_ids or []) + list(getattr(requests[rid], "output_token_ids", []))
                for rid in fresh}

    def stats(self) -> dict:
        return self.core.stats()

    def close(self) -> None:
        """Drop the connection (idempotent); the drafter drafts no more."""
        self.core.close()


class RemoteDFlashProposer(RemoteProposerBase, DFlashProposer):
    """``method: "dflash"`` with the draft model in a ``k3-draft-server``."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner
        self.core = RemoteDrafter(device)
        self.supports_mm_inputs = False       # no local draft model to feed embeddings to
        self.hidden_states = None             # draft-model input buffers: never used remotely
        self.inputs_embeds = None

    def load_model(self, target_model: Any) -> None:
        """No draft weights on the target: connect to the draft server instead."""
        self.core.open(self.vllm_config, self.device, device_rows=True)

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
        """``[batch_size, K]`` int64 on the device, -1 where there is no draft."""
        k = int(num_speculative_tokens)
        self._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        num_reqs = min(batch_size, self.runner.input_batch.num_reqs)

        def build(keep: np.ndarray, fresh: list[str]):
            cad, n = common_attn_metadata, num_reqs
            rejected = None if num_rejected_tokens_gpu is None else num_rejected_tokens_gpu[:n].cpu().numpy()
            batch = BatchRows.from_counts(self.runner.input_batch.req_ids[:n], cad.query_start_loc_cpu.numpy(),
                                          rejected, ~np.asarray(self.runner.discard_request_mask.np[:n]))
            kept = torch.from_numpy(keep).to(next_token_ids.device)
            return gather_step(batch, keep, positions=target_positions, token_ids=target_token_ids,
                               hidden=[target_hidden_states] if self.core.ships_hidden else None,
                               anchor_tokens=next_token_ids.index_select(0, kept), k=k,
                               prompts=self._prompts(fresh))

        return self._step(num_reqs, k, build, pad_to=batch_size)
