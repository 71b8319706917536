"""TP=2 over gloo: only rank 0 talks to the draft server; both ranks verify the same drafts
(rank 1 never reads a device tensor on the host to get them).

Two spawned processes join a real gloo group; vLLM's own
``init_distributed_environment`` / ``initialize_model_parallel`` build the TP
group (``GroupCoordinator``), the wrapped ``init_speculator`` builds the
speculator on each rank from the same (pickled) ``VllmConfig``.
"""
from __future__ import annotations

import pickle

import pytest

from helpers.ranks import run_ranks
from helpers.v2_sim import K, expected_v2

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.worker.gpu.spec_decode")

A = [7, 8, 9, 10, 11] * 3 + [1, 2, 3]
B = [1, 2, 3, 4, 1, 2, 3]
P = [5, 6, 7, 8] * 6


def _rank(rank: int, world: int, config_bytes: bytes) -> tuple:
    import torch
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    from helpers.standin import DeviceSim, own_buffers_as_device
    from helpers.v2_sim import Sched, Sim, server_stats, vllm_world
    from k3_accel.vllm.spec_decode import hooks

    config = pickle.loads(config_bytes)
    hooks.install_v2()
    # rank 1 gets garbage rows: it never ships them, its drafts come from rank 0's broadcast
    a, b, p = (A, B, P) if rank == 0 else ([0] * len(A), [0] * len(B), [0] * len(P))
    with vllm_world(config, tp=world, rank=rank) as group:
        # the non-driver rank sees device stand-ins only: receiving drafts must not read any on the host
        sim = Sim() if rank == 0 else DeviceSim()
        spec = spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)
        if rank:
            own_buffers_as_device(spec)
        connected = spec.core.session.client is not None
        sim.add("a", a)
        sim.add("b", b)
        sim.add("p", p)
        out = [sim.dummy_propose(spec, num_reqs=2, num_tokens=16).tolist(),
               sim.propose(spec, [Sched("a", 0, a, sampled=7), Sched("b", 0, b, sampled=4),
                                  Sched("p", 0, p[:16], next_prompt=p[16])]).tolist(),
               # a K=0 step (skip_drafts): context still goes out, through rank 0 only
               sim.propose(spec, [Sched("p", 16, p[16:], sampled=5)], k=0).tolist(),
               sim.propose(spec, [Sched("a", 18, [7, 8, 9, 99, 99], sampled=5, rejected=2, drafts=4),
                                  Sched("p", 24, [5], sampled=6)]).tolist()]
        stats = None
        if connected:
            stats = server_stats(spec)
        result = (group.rank_in_group, group.world_size, connected, out, stats)
        spec.close()
    return result


def test_tp2_ranks_get_identical_drafts_and_only_rank0_connects(vllm_config, ngram_server):
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1",
           "VLLM_K3_DRAFT_REMOTE_ADDRESS": ngram_server.address,
           "VLLM_K3_DRAFT_ADAPTIVE": "off",
           "VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS": "20000"}   # a CPU server on a busy box: exact drafts, not timing
    r0, r1 = run_ranks(_rank, 2, pickle.dumps(vllm_config), env=env, timeout=300)
    assert r0[:3] == (0, 2, True) and r1[:3] == (1, 2, False)
    assert r0[3] == r1[3]                                   # identical drafts on both ranks, every step
    dummy, first, k0, last = r0[3]
    assert dummy == [[-1] * K] * 2
    assert first == [expected_v2(A, 7), expected_v2(B, 4), [0] * K]     # p mid-prefill: no draft
    assert k0 == [[-1] * K]                                  # K=0: the runner sets every column to -1
    assert last == [expected_v2(A + [7, 8, 9], 5), expected_v2(P + [5], 6)]
    stats = r0[4]
    assert stats["ops"]["hello"] == 1                       # one client: rank 0's
    assert stats["errors"] == {} and stats["ingested_rows"] == len(A) + len(B) + len(P) + 3 + 1


def _rank_launch_fails(rank: int, world: int, config_bytes: bytes) -> tuple:
    import torch
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    from helpers.v2_sim import Sched, Sim, vllm_world
    from k3_accel.vllm.spec_decode import hooks, v2

    config = pickle.loads(config_bytes)
    hooks.install_v2()
    real, calls = v2.launch, []

    def launch(*args, **kw):                 # rank 0's first launch fails (rank 1 never launches)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("planted: the step's context could not be launched")
        return real(*args, **kw)
    v2.launch = launch
    a, b = (A, B) if rank == 0 else ([0] * len(A), [0] * len(B))
    with vllm_world(config, tp=world, rank=rank) as group:
        sim = Sim()
        spec = spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)
        sim.add("a", a)
        sim.add("b", b)
        out = [sim.propose(spec, [Sched("a", 0, a, sampled=7)]).tolist(),
               sim.propose(spec, [Sched("b", 0, b, sampled=4)]).tolist()]
        failures = spec.stats()["adapter"].get("failures.step_input", 0)
        spec.close()
    return out, len(calls), failures


def test_tp2_every_rank_reaches_the_broadcast_when_rank0_cannot_launch(vllm_config, ngram_server):
    """Rank 0's launch fails in one step: it still broadcasts (no drafts), so rank 1 does not
    hang in the collective; both ranks verify the same (no) drafts, and the next step drafts."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1",
           "VLLM_K3_DRAFT_REMOTE_ADDRESS": ngram_server.address, "VLLM_K3_DRAFT_ADAPTIVE": "off",
           "VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS": "20000"}   # a CPU server on a busy box: exact drafts, not timing
    r0, r1 = run_ranks(_rank_launch_fails, 2, pickle.dumps(vllm_config), env=env, timeout=300)
    assert r0[0] == r1[0]                                   # the same drafts on both ranks, both steps
    failed, after = r0[0]
    assert failed != [expected_v2(A, 7)] and r0[1] == 2 and r1[1] == 0
    assert after == [expected_v2(B, 4)]                     # the next step drafts
    assert (r0[2], r1[2]) == (1, 0)


def _rank_driver_cannot_start(rank: int, world: int, config_bytes: bytes) -> tuple:
    import torch
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    import k3_accel.transport.client as client
    from helpers.v2_sim import Sched, Sim, vllm_world
    from k3_accel.vllm.spec_decode import hooks

    config = pickle.loads(config_bytes)
    hooks.install_v2()
    if rank == 0:                            # only the driver builds a client: only it fails to start

        class NoClient:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("planted: the draft client could not be built")
        client.DraftClient = NoClient
    with vllm_world(config, tp=world, rank=rank):
        sim = Sim()
        spec = spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)
        sim.add("a", A)
        out = sim.propose(spec, [Sched("a", 0, A, sampled=7)]).tolist()
        disabled = spec.disabled is not None
        spec.close()
    return out, disabled


def test_tp2_a_driver_that_cannot_start_turns_drafting_off_on_every_rank(vllm_config, ngram_server):
    """Remote drafting is on on every TP rank or on none: a driver whose construction failed (drafting
    off there, one error line) never broadcasts, so a rank that still drafted would wait in the drafts'
    broadcast for good."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1",
           "VLLM_K3_DRAFT_REMOTE_ADDRESS": ngram_server.address, "VLLM_K3_DRAFT_ADAPTIVE": "off"}
    r0, r1 = run_ranks(_rank_driver_cannot_start, 2, pickle.dumps(vllm_config), env=env, timeout=120)
    assert r0 == r1 == ([[7] * K], True)          # no drafts (the filler), drafting off on both ranks


def _rank_fence_fails(rank: int, world: int, config_bytes: bytes) -> tuple:
    import torch
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    from helpers.v2_sim import Sched, Sim, vllm_world
    from k3_accel.vllm.spec_decode import hooks
    from k3_accel.vllm.spec_decode.fence import FenceUnavailable, HostFence

    class RefusingFence(HostFence):
        """A device fence whose first enqueue the driver refuses (then the host waits, as on CPU)."""
        on_device = True

        def enqueue(self, seq, stream):
            self.on_device = False
            raise FenceUnavailable("planted: cuStreamWaitValue64 returned CUresult 1")

    config = pickle.loads(config_bytes)
    hooks.install_v2()
    a, b = (A, B) if rank == 0 else ([0] * len(A), [0] * len(B))
    with vllm_world(config, tp=world, rank=rank):
        sim = Sim()
        spec = spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)
        if rank == 0:
            torch.cuda.current_stream = lambda device=None: None     # stand-in for the GPU's stream
            spec.core.session.pipeline.fence = RefusingFence()
        sim.add("a", a)
        sim.add("b", b)
        out = [sim.propose(spec, [Sched("a", 0, a, sampled=7)]).tolist(),
               sim.propose(spec, [Sched("b", 0, b, sampled=4)]).tolist()]
        failures = spec.stats()["adapter"].get("failures", 0)
        spec.close()
    return out, failures


def test_tp2_a_fence_the_gpu_refuses_fails_the_step_closed_on_every_rank(vllm_config, ngram_server):
    """The compute stream's wait for the drafts cannot be enqueued (``FenceUnavailable``): the step goes
    on without drafts, the failure counted, and the driver still reaches the drafts' broadcast (raising
    there was an engine error on rank 0 and rank 1 waiting in the collective); the next step drafts."""
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1",
           "VLLM_K3_DRAFT_REMOTE_ADDRESS": ngram_server.address, "VLLM_K3_DRAFT_ADAPTIVE": "off",
           "VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS": "20000"}   # a CPU server on a busy box: exact drafts, not timing
    r0, r1 = run_ranks(_rank_fence_fails, 2, pickle.dumps(vllm_config), env=env, timeout=300)
    assert r0[0] == r1[0]                                   # the same drafts on both ranks, both steps
    failed, after = r0[0]
    assert failed == [[7] * K]                              # no drafts: the last sampled token (the filler)
    assert after == [expected_v2(B, 4)]                     # the next step drafts
    assert (r0[1], r1[1]) == (1, 0)
