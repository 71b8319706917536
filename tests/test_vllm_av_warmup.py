"""vLLM's adaptive-verification slot ranking is compiled at engine start, not inside a step.

vLLM 0.33 ranks draft slots with a ``torch.compile(dynamic=True)`` function only in a step whose
budget binds, so without a warm-up it compiles there (a 0.6-1.2 s stall of the engine on the GPU
machines), and again for the first batch of one request. The speculator's ``capture`` (vLLM's
graph capture) calls it for the shapes and dtypes a step gives it. vLLM's compiled function is
wrapped here so the calls are seen (and run eagerly: a CPU compile is not what is tested).
"""
from __future__ import annotations

import copy

import pytest
import torch

from helpers.v2_sim import Sim

pytestmark = [pytest.mark.vllm, pytest.mark.vllm033]
av = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.adaptive_verification")
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def rank(probs, idx_mapping, capacities, budget, num_steps):
        seen.append({"probs": (tuple(probs.shape), probs.dtype), "idx": idx_mapping.dtype,
                     "caps": (capacities.shape[0], capacities.dtype, int(capacities.sum())),
                     "budget": budget, "steps": num_steps, "inference": torch.is_inference_mode_enabled()})
        av._assign_draft_token_budget(probs, idx_mapping, capacities, budget, num_steps)
        seen[-1]["admitted"] = int(capacities.sum())

    monkeypatch.setattr(av, "_assign_draft_token_budget_compiled", rank)
    return seen


def test_the_ranking_runs_for_one_request_and_for_several_with_a_budget_that_binds(calls):
    from k3_accel.vllm.spec_decode import confidence
    assert confidence.warm_budget(torch.device("cpu"), 8, 4) == len(calls) == 4
    assert {(c["caps"][0], c["budget"]) for c in calls} == {(2, 2), (2, 1), (1, 2), (1, 1)}
    for c in calls:
        # the runner's dtypes: confidences float32 [max_reqs, K], slot mapping int64, capacities int32
        assert c["probs"] == ((8, 4), torch.float32) and c["idx"] == torch.int64 and c["caps"][1] == torch.int32
        assert c["steps"] == 4 and c["inference"]
        assert c["budget"] < c["caps"][2] and c["admitted"] == c["budget"]     # it bound, and ranked


def test_a_single_draft_position_never_asks_for_a_budget_that_cannot_bind(calls):
    from k3_accel.vllm.spec_decode import confidence
    confidence.warm_budget(torch.device("cpu"), 1, 1)
    assert calls == []                                   # one request of one draft: no budget below it


@pytest.mark.parametrize("adaptive", [True, False])
def test_capture_compiles_it_only_with_adaptive_verification(vllm_config, tp_group, ngram_server, monkeypatch,
                                                             calls, adaptive):
    config = copy.deepcopy(vllm_config)
    config.speculative_config.enable_adaptive_verification = adaptive
    from k3_accel.vllm.spec_decode import hooks
    hooks.install_v2()
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ngram_server.address)
    spec = spec_decode.init_speculator(config, torch.device("cpu"), Sim().req_states)
    try:
        assert type(spec).__name__ == "RemoteSpeculatorV2"
        spec.capture()
        assert len(calls) == (4 if adaptive else 0)
    finally:
        spec.close()
