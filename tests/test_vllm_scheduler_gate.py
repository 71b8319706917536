"""The scheduler gate: vLLM's real ``AsyncScheduler`` schedules no draft slots while the adaptive
controller has speculation off, and K again once it opens the gate.

Real vLLM (the CUDA wheel with ``VLLM_TARGET_DEVICE=cpu``), a real ``VllmConfig`` of the V2
runner and vLLM's own scheduler classes; the gate's writer is what the driver rank's draft
thread holds (:class:`~k3_accel.vllm.spec_decode.pipeline.DraftPipeline`).
"""
from __future__ import annotations

import copy

import pytest

from helpers.v2_sim import K

pytestmark = pytest.mark.vllm
sched_mod = pytest.importorskip("vllm.v1.core.sched.async_scheduler")


@pytest.fixture
def v2_config(vllm_config, monkeypatch):
    """The session's config with an address, on the V2 runner (vLLM picks V1 on a CPU without
    Triton unless told), a fresh engine id, and KV blocks for the scheduler."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cfg = copy.copy(vllm_config)
    cfg.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9"}}
    cfg.instance_id = f"gate-test-{id(cfg)}"
    cfg.cache_config = copy.copy(vllm_config.cache_config)
    cfg.cache_config.num_gpu_blocks = 256
    assert cfg.use_v2_model_runner
    return cfg


def _scheduler(cfg):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from k3_accel.vllm.spec_decode import hooks
    hooks.install_gate()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return sched_mod.AsyncScheduler(vllm_config=cfg, kv_cache_config=kv,
                                    structured_output_manager=StructuredOutputManager(cfg), block_size=16)


def _add(s, rid: str, prompt_len: int) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    s.add_request(Request(rid, prompt_token_ids=list(range(1, prompt_len + 1)),
                          sampling_params=SamplingParams(max_tokens=200), pooling_params=None))


def _drafts(out) -> dict[str, int]:
    return {rid: len(t) for rid, t in out.scheduled_spec_decode_tokens.items()}


def test_a_closed_gate_schedules_plain_decodes_and_an_open_one_k_again(v2_config):
    from k3_accel.vllm.spec_decode.gate import Gate
    s = _scheduler(v2_config)
    writer = Gate.for_engine(v2_config, writer=True)
    assert writer is not None
    try:
        for i in range(3):
            _add(s, f"r{i}", 19 + i)
        first = s.schedule()                                   # the prefills
        assert first.num_spec_tokens_to_schedule == K
        second = s.schedule()                                  # decodes with K placeholder drafts each
        assert _drafts(second) == {f"r{i}": K for i in range(3)}
        writer.set(0)                                          # the controller: speculation off
        third = s.schedule()
        assert third.num_spec_tokens_to_schedule == 0          # the propose after this step asks nothing
        assert _drafts(third) == {f"r{i}": K for i in range(3)}    # placeholders set before the gate closed
        fourth = s.schedule()
        assert _drafts(fourth) == {} and set(fourth.num_scheduled_tokens.values()) == {1}   # plain decodes
        writer.set(K)                                          # a probe is due: the gate opens
        fifth = s.schedule()
        assert fifth.num_spec_tokens_to_schedule == K and _drafts(fifth) == {}
        sixth = s.schedule()
        assert _drafts(sixth) == {f"r{i}": K for i in range(3)}
        writer.set(2)                                          # never more than vLLM's own K, capped by the gate
        s.schedule()
        assert _drafts(s.schedule()) == {f"r{i}": 2 for i in range(3)}
    finally:
        writer.close()
    s.schedule()                                               # a closed writer: vLLM's own K again
    assert _drafts(s.schedule()) == {f"r{i}": K for i in range(3)}


def test_no_gate_without_the_adaptive_controller_or_the_v2_runner(v2_config, monkeypatch):
    from k3_accel.vllm.spec_decode.gate import Gate, applies
    assert applies(v2_config)
    fixed = copy.copy(v2_config)
    fixed.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "adaptive": False}}
    floor = copy.copy(v2_config)
    floor.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "adaptive_min_k": 1}}
    local = copy.copy(v2_config)
    local.additional_config = {}
    assert not applies(fixed) and not applies(floor) and not applies(local)
    assert Gate.for_engine(fixed, writer=True) is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not applies(v2_config)                              # V1 schedules only the drafts it has


def test_a_scheduler_without_a_readable_gate_schedules_as_stock(v2_config):
    s = _scheduler(v2_config)                                  # no writer for this engine
    _add(s, "a", 17)
    s.schedule()
    out = s.schedule()
    assert out.num_spec_tokens_to_schedule == K and _drafts(out) == {"a": K}
