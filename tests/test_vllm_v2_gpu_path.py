"""The V2 path as vLLM runs it on a GPU, driven on CPU with vLLM 0.33's real V2 objects.

* the step never reads device data on the host (``helpers.standin``: every
  tensor vLLM hands ``propose`` is a device stand-in whose host reads raise);
* every device buffer exists, at its final size, once the speculator is built;
* vLLM's warm-up steps send nothing; a slow reply costs the step its drafts,
  not the request; requests draft again after the server restarts;
* a request without drafts is verified as a plain decode (V2: confidence 0
  for vLLM's adaptive verification; V1: no placeholder drafts scheduled);
* the aux layer ids are vLLM's own resolution; a draft whose heads do not
  divide the target's TP starts.
"""
from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from helpers.server import ServerProcess
from helpers.standin import DeviceSim, HostRead, dev, no_host_sync, own_buffers_as_device
from helpers.v2_sim import K, MAX_TOKENS, Sched, Sim, client_stats, expected_v2, server_stats

pytestmark = pytest.mark.vllm
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")


@pytest.fixture
def sim():
    return Sim()


def _speculator(vllm_config, sim, address, monkeypatch, **env):
    from k3_accel.vllm.spec_decode import hooks

    hooks.install_v2()
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", address)
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE", "off")         # a fixed K: these tests check exact drafts
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return spec_decode.init_speculator(vllm_config, torch.device("cpu"), sim.req_states)


@pytest.fixture
def speculator(vllm_config, tp_group, ngram_server, sim, monkeypatch):
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch,
                       VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    yield spec
    spec.close()


# ------------------------------------------------------------------ no host sync
def test_the_stand_in_catches_host_reads():
    t = dev(torch.arange(4))
    with no_host_sync(), pytest.raises(HostRead):
        t.tolist()
    with no_host_sync(), pytest.raises(HostRead):
        torch.empty(4, dtype=torch.int64).copy_(t)


def test_v2_step_never_syncs(vllm_config, tp_group, ngram_server, monkeypatch):
    sim = DeviceSim()
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch,
                       VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    try:
        own_buffers_as_device(spec)
        a = [7, 8, 9, 10, 11] * 3 + [1, 2, 3]
        p = [5, 6, 7, 8] * 10
        h = [3, 1, 4, 1, 5, 9, 2, 6]
        sim.add("a", a)
        sim.add("p", p)
        sim.add("h", h, num_computed=4)                 # prefix-cache hit: its history is copied too
        # a deferred mid-prefill chunk alone (nothing waits for the server)
        d = sim.propose(spec, [Sched("p", 0, p[:16], next_prompt=p[16])])
        assert d.tolist() == [[0] * K]
        # a proposing prefill, a mid-prefill chunk and a prefix-cache hit in one step
        d = sim.propose(spec, [Sched("a", 0, a, sampled=7), Sched("p", 16, p[16:32], next_prompt=p[32]),
                               Sched("h", 4, h[4:], sampled=3)])
        assert d.tolist()[0] == expected_v2(a, 7) and d.tolist()[1] == [0] * K
        # decode with partial acceptance (2 of 4 drafts; the 99s are rejected rows)
        d = sim.propose(spec, [Sched("a", 18, [7, 8, 9, 99, 99], sampled=5, rejected=2, drafts=4),
                               Sched("p", 32, p[32:], sampled=5)])
        assert d.tolist() == [expected_v2(a + [7, 8, 9], 5), expected_v2(p, 5)]
        assert not spec.stats()["adapter"].get("failures")
        assert server_stats(spec)["errors"] == {}
    finally:
        spec.close()


# --------------------------------------------------------------------- memory
def test_v2_buffers_allocated_before_profiling(speculator, sim, vllm_config):
    facts = speculator.core.session.facts
    rows = speculator.rows
    assert rows.hidden.shape == (vllm_config.scheduler_config.max_num_batched_tokens + 1, facts.context_width)
    assert rows.token_ids.shape == (MAX_TOKENS + 1,) and rows.meta.shape[1] == vllm_config.scheduler_config.max_num_seqs
    before = {name: getattr(rows, name).data_ptr() for name in ("token_ids", "hidden", "meta")}
    a = [1, 2, 3, 4, 1, 2, 3] * 30
    sim.add("a", a[:200])
    sim.propose(speculator, [Sched("a", 0, a[:100], next_prompt=a[100])])          # deferred chunk
    sim.propose(speculator, [Sched("a", 100, a[100:200], sampled=4)])              # propose
    speculator.flush()
    assert {name: getattr(rows, name).data_ptr() for name in before} == before     # nothing reallocated
    ring = speculator.core.session.client.ring
    assert all(not slot.device for slot in ring.slots)        # the transport made no device buffer of its own


def test_the_drafts_broadcast_uses_a_communicator_vllm_set_up():
    from k3_accel.vllm.spec_decode.session import broadcaster

    one = types.SimpleNamespace(world_size=1)
    broadcaster(one, torch.device("cuda"))(torch.zeros(1))         # one rank: nothing to do, nothing made
    no_nccl = types.SimpleNamespace(world_size=2, device_communicator=types.SimpleNamespace(pynccl_comm=None))
    with pytest.raises(RuntimeError, match="PyNCCL"):
        broadcaster(no_nccl, torch.device("cuda"))
    sent = []
    nccl = types.SimpleNamespace(disabled=False, broadcast=lambda t, src: sent.append((t, src)))
    group = types.SimpleNamespace(world_size=2, device_communicator=types.SimpleNamespace(pynccl_comm=nccl))
    t = torch.zeros(2)
    broadcaster(group, torch.device("cuda"))(t)
    assert sent == [(t, 0)]


# ------------------------------------------------------------------- warm-up
def test_v2_warmup_sends_nothing(speculator, sim):
    ids = [f"_warmup_{i}_" for i in range(2)] + ["_v2_mixed_warmup_decode_"]
    for rid in ids:
        sim.add(rid, [1, 2, 1, 2])
    d = sim.propose(speculator, [Sched(rid, 0, [1, 2, 1, 2], sampled=1) for rid in ids])
    assert d.tolist() == [[1] * K] * 3                       # no drafts (last sampled token)
    ops = server_stats(speculator)["ops"]
    assert not ops.get("ingest") and not ops.get("propose")
    assert speculator.stats()["adapter"]["warmup_steps"] == 1
    sim.add("real", [1, 2, 1, 2])                             # the first real step drafts
    assert sim.propose(speculator, [Sched("real", 0, [1, 2, 1, 2], sampled=1)]).tolist() == [expected_v2([1, 2, 1, 2], 1)]


def test_an_unreachable_server_does_not_delay_construction(vllm_config, tp_group, sim, monkeypatch):
    import threading

    from helpers.ports import free_port
    from k3_accel.transport.link import Link

    started_on = []
    start = Link.start
    monkeypatch.setattr(Link, "start", lambda self, wait_s: (started_on.append(threading.current_thread()),
                                                              start(self, wait_s))[1])
    # a long propose timeout: the GPU deadline then waits out the first step, so the second sees the link down
    spec = _speculator(vllm_config, sim, f"tcp://127.0.0.1:{free_port()}", monkeypatch,
                       VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS="30000", VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    try:
        sim.add("a", [1, 2, 1, 2])
        d = sim.propose(spec, [Sched("a", 0, [1, 2, 1, 2], sampled=1)])
        assert d.tolist() == [[1] * K]
        d = sim.propose(spec, [Sched("a", 4, [1], sampled=2)])      # the link is down: nothing is gathered
        assert d.tolist() == [[2] * K]
        stats = client_stats(spec, ready=False)
        assert stats["state"] != "ready" and stats["counters"]["link_down_steps"] >= 1
    finally:
        spec.close()
    # the hello (up to the 30 s timeout) is waited for on the draft thread, never in the runner's __init__
    assert len(started_on) == 1 and started_on[0] is not threading.main_thread()


# ------------------------------------------------------------ slow and restarted servers
def test_propose_timeout_is_step_sized(monkeypatch):
    from k3_accel.config import load_config
    from k3_accel.transport.api import ClientSettings

    cfg = load_config(environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": "tcp://127.0.0.1:1"})
    s = ClientSettings.from_config(cfg)
    assert s.propose_timeout_s <= 0.1 < 10 <= s.timeout_s          # tens of ms vs the control timeout
    cfg = load_config({"k3_accel": {"draft_address": "tcp://127.0.0.1:1", "draft_propose_timeout_ms": 250}}, {})
    assert ClientSettings.from_config(cfg).propose_timeout_ms == 250


def test_a_late_reply_costs_the_step_not_the_request(client_factory):
    """A propose whose reply comes after the propose timeout: that step has no drafts, the
    request is not disabled, and the next step drafts from the full context."""
    from helpers.relay import Relay
    from helpers.steps import step
    from helpers.v2_sim import expected

    server = ServerProcess("--engine", "ngram")
    relay = Relay(server.address)
    try:
        client = client_factory(relay.address, propose_timeout_ms=1000)
        hist = [1, 2, 3, 1, 2]
        out = client.step(step(["r"], [(0, hist)], anchors=[3], k=3))
        assert out.drafts.tolist() == [expected(hist, 3, 3)]
        relay.pause()                                          # the next reply comes late
        out = client.step(step(["r"], [(5, [3])], anchors=[1], k=3))
        relay.resume()
        assert out.drafts.tolist() == [[-1, -1, -1]]
        assert not client.is_disabled("r")
        out = client.step(step(["r"], [(6, [1])], anchors=[2], k=3))
        assert out.drafts.tolist() == [expected(hist + [3, 1], 2, 3)]
        assert client.stats()["counters"]["late_proposals"] == 1
    finally:
        relay.close()
        server.stop()


def test_requests_draft_again_after_server_restart(vllm_config, tp_group, sim, monkeypatch):
    server = ServerProcess("--engine", "ngram")
    spec = _speculator(vllm_config, sim, server.address, monkeypatch, VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    try:
        a = [4, 5, 6, 4, 5, 6, 4, 5]
        sim.add("a", a)
        assert sim.propose(spec, [Sched("a", 0, a, sampled=6)]).tolist() == [expected_v2(a, 6)]
        server.stop()
        server = ServerProcess("--engine", "ngram", "--port", server.address.rsplit(":", 1)[1])
        hist, got = a + [6], None
        for _ in range(60):                               # decode on; the request must draft again
            sim.req_states.all_token_ids.gpu[sim.req_states.req_id_to_index["a"], :len(hist)] = \
                torch.tensor(hist, dtype=torch.int32)
            tok = hist[-3]
            got = sim.propose(spec, [Sched("a", len(hist) - 1, [hist[-1]], sampled=tok)]).tolist()
            hist.append(tok)
            if got == [expected_v2(hist[:-1], tok)] and got != [[tok] * K]:
                break
            time.sleep(0.1)
        assert got == [expected_v2(hist[:-1], hist[-1])]
        assert client_stats(spec)["counters"].get("rearmed_requests", 0) >= 1
    finally:
        spec.close()
        server.stop()


# ----------------------------------------------------------- no draft, no cost
def test_no_drafts_schedules_no_spec_tokens_v2(speculator, sim):
    """V2: vLLM's adaptive verification sizes each request's verification from the speculator's
    per-position confidence; a position without a draft has 0 and is never admitted."""
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import _assign_draft_token_budget

    a, b = [1, 2, 3, 1, 2], [9, 8, 7, 6, 5]                   # b: no repeated n-gram, no draft
    sim.add("a", a)
    sim.add("b", b)
    sim.propose(speculator, [Sched("a", 0, a, sampled=3), Sched("b", 0, b, sampled=4)])
    from helpers.v2_sim import expected
    real = [float(t >= 0) for t in expected(a, 3)]
    assert 0 < sum(real) and expected(b, 4) == [-1] * K
    conf = speculator.draft_token_confidence_probs[:2]
    assert conf[0].tolist() == real and conf[1].tolist() == [0.0] * K
    capacities = torch.full((2,), K, dtype=torch.int32)
    budget = int(sum(real))                                   # room for as many drafts as came
    _assign_draft_token_budget(speculator.draft_token_confidence_probs, torch.arange(2), capacities, budget, K)
    assert capacities.tolist() == [budget, 0]                 # b is verified as a plain decode


def test_no_drafts_schedules_no_spec_tokens_v1():
    """V1: the drafts the scheduler gets end at the first -1, so vLLM's scheduler gives a request
    without drafts no spec tokens (its real ``update_draft_token_ids``)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds

    from k3_accel.vllm.spec_decode.hooks import _wrap_take_drafts

    runner = types.SimpleNamespace(drafter=types.SimpleNamespace(is_remote_drafter=True))
    take = _wrap_take_drafts(lambda self: DraftTokenIds(["a", "b", "c"], [[5, 6, -1], [-1, -1, -1], [7, 8, 9]]))
    drafts = take(runner)
    reqs = {rid: types.SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=False, spec_token_ids=[])
            for rid in "abc"}
    sched = types.SimpleNamespace(requests=reqs, structured_output_manager=types.SimpleNamespace(
        validate_tokens=lambda request, ids: ids))
    Scheduler.update_draft_token_ids(sched, drafts)
    assert [reqs[r].spec_token_ids for r in "abc"] == [[5, 6], [], [7, 8, 9]]
    local = types.SimpleNamespace(drafter=object())           # a runner drafting locally is untouched
    assert take(local).draft_token_ids[1] == [-1, -1, -1]


# ----------------------------------------------------------------- start-up
@pytest.mark.parametrize("hf, want", [
    ({"dflash_config": {"target_layer_ids": [2, 0]}}, (0, 2)),
    ({"dflash_config": {"target_layer_ids": [1, 1, 3]}}, (1, 3)),
    ({"eagle_aux_hidden_state_layer_ids": [3, 5], "dflash_config": {"target_layer_ids": [0, 1]}}, (2, 4)),
    ({"target_layer_ids": [4, 0]}, (0, 4)),
    ({"dflash_config": {"layer_ids": [2, 4]}}, (1, 3)),
])
def test_v2_aux_layer_ids_follow_vllm(hf, want):
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from k3_accel.vllm.spec_decode.session import aux_layer_ids

    spec = types.SimpleNamespace(method="dflash", model="draft", draft_model_config=types.SimpleNamespace(
        hf_config=types.SimpleNamespace(**hf)))
    ids = aux_layer_ids(spec)
    assert ids == want
    captured = tuple(sorted(set(get_eagle3_aux_layers_from_config(spec))))   # what vLLM captures
    assert tuple(i + 1 for i in ids) == captured


def test_v2_draft_tp_mismatch_starts(tmp_path, monkeypatch):
    """TP=4 with a 6-head draft: vLLM alone refuses it; with a draft address the plugin makes the
    (never run) draft's TP 1 and the config builds."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
    from k3_accel.vllm.spec_decode import hooks

    target = write_tiny_target(str(tmp_path / "target"), vocab_size=512, hidden_size=128, dtype="bfloat16",
                               num_heads=8, num_kv_heads=4, head_dim=16)
    draft = write_tiny_dflash(str(tmp_path / "draft"), target, target_layer_ids=(0, 2), dtype="bfloat16")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = 6, 6
    (draft / "config.json").write_text(json.dumps(cfg))
    hooks.install_draft_tp()

    def build(extra):
        args = EngineArgs(model=str(target), max_model_len=256, max_num_seqs=4, enforce_eager=True,
                          tensor_parallel_size=4, distributed_executor_backend="mp", additional_config=extra,
                          speculative_config={"method": "dflash", "model": str(draft), "num_speculative_tokens": 4})
        from vllm.config import ParallelConfig
        return args.create_speculative_config(args.create_model_config(), ParallelConfig(tensor_parallel_size=4))

    monkeypatch.delenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", raising=False)
    with pytest.raises(Exception, match="divisible"):
        build({})
    spec = build({"k3_accel": {"draft_address": "tcp://127.0.0.1:5557"}})
    assert spec.draft_tensor_parallel_size == 1


# ------------------------------------------------------- the per-step K controller
def test_fewer_drafts_reach_vllm(vllm_config, tp_group, ngram_server, monkeypatch):
    """When the controller gives one request 2 drafts and another none in a step, V2's runner gets
    exactly that (the rest: filler with confidence 0), and V1's scheduler gets 2 and 0 drafts."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds

    from k3_accel.vllm.spec_decode.hooks import drafts_for_scheduler
    from helpers.v2_sim import expected

    sim = Sim()
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch, VLLM_K3_DRAFT_ADAPTIVE="on",
                       VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    try:
        controller = spec.core.session.pipeline.controller
        assert controller is not None                          # adaptive is the default
        monkeypatch.setattr(controller, "choose", lambda ids, sampled, counts, held=False: np.array([2, 0, K]))
        a, b, c = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [7, 8, 7, 8, 7]
        for rid, p in zip("abc", (a, b, c)):
            sim.add(rid, p)
        d = sim.propose(spec, [Sched("a", 0, a, sampled=3), Sched("b", 0, b, sampled=6), Sched("c", 0, c, sampled=8)])
        full = [expected(a, 3), expected(b, 6), expected(c, 8)]
        assert d.tolist() == [full[0][:2] + [3] * (K - 2), [6] * K, [x if x >= 0 else 8 for x in full[2]]]
        conf = spec.draft_token_confidence_probs[:3].tolist()
        assert conf[0] == [1.0, 1.0] + [0.0] * (K - 2) and conf[1] == [0.0] * K
        # V1: the same decision reaches vLLM's scheduler as 2, 0 and K drafts
        masked = [full[0][:2] + [-1] * (K - 2), [-1] * K, full[2]]
        reqs = {rid: types.SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=False, spec_token_ids=[])
                for rid in "abc"}
        sched = types.SimpleNamespace(requests=reqs, structured_output_manager=types.SimpleNamespace(
            validate_tokens=lambda request, ids: ids))
        Scheduler.update_draft_token_ids(sched, DraftTokenIds(list("abc"), drafts_for_scheduler(masked)))
        assert [len(reqs[r].spec_token_ids) for r in "abc"] == [2, 0, sum(t >= 0 for t in full[2])]
        assert "acceptance_per_position" in client_stats(spec)["controller"]     # visible in the stats
    finally:
        spec.close()


def test_with_adaptive_verification_vllm_gets_the_controllers_acceptance_estimate(vllm_config, tp_group,
                                                                                  ngram_server, monkeypatch):
    """With vLLM's adaptive verification and a server that sends no confidence (n-gram, DFlash), the
    runner's ``draft_token_confidence_probs`` holds the controller's estimated acceptance of each draft
    it handed out (0 where it gave none), which vLLM ranks and budgets with."""
    monkeypatch.setattr(vllm_config.speculative_config, "enable_adaptive_verification", True, raising=False)
    sim = Sim()
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch, VLLM_K3_DRAFT_ADAPTIVE="on",
                       VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    try:
        controller = spec.core.session.pipeline.controller
        monkeypatch.setattr(controller, "choose", lambda ids, sampled, counts, held=False: np.array([2, 0]))
        a, b = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5]
        sim.add("a", a)
        sim.add("b", b)
        sim.propose(spec, [Sched("a", 0, a, sampled=3), Sched("b", 0, b, sampled=6)])
        conf = spec.draft_token_confidence_probs[:2]
        want = torch.from_numpy(controller.acceptance.rates(["a"])[0, :2]).float()
        assert torch.equal(conf[0, :2], want) and (conf[0, 2:] == 0).all() and (conf[1] == 0).all()
        assert (want > 0).all() and (want < 1).all()          # an estimate (the prior here), not a flag
    finally:
        spec.close()


def test_a_step_behind_the_deadline_asks_for_no_drafts_but_ships_its_rows(speculator, sim):
    """While a step the GPU deadline released is still running on the draft thread, later steps
    ask the server for nothing (the GPU would only wait for the deadline again) yet ship their rows,
    so the server's context stays whole and drafting resumes once the thread has caught up."""
    a = [1, 2, 3, 1, 2]
    sim.add("a", a)
    pipe = speculator.core.session.pipeline
    with pipe._lock:
        pipe._expired.add(10 ** 9)                             # as if a released step still ran
    try:
        d = sim.propose(speculator, [Sched("a", 0, a, sampled=3)])
        assert d.tolist() == [[3] * K]                         # no drafts: the last sampled token
        speculator.flush()
        stats = server_stats(speculator)
        assert not stats["ops"].get("propose") and stats["ops"].get("ingest")
    finally:
        with pipe._lock:
            pipe._expired.discard(10 ** 9)
    d = sim.propose(speculator, [Sched("a", len(a), [3], sampled=1)])
    assert d.tolist() == [expected_v2(a + [3], 1)]             # the context the server kept is whole


def test_a_step_the_controller_holds_off_is_an_ingest_nothing_waits_for(vllm_config, tp_group, ngram_server, sim,
                                                                       monkeypatch):
    """While the adaptive controller is off and no probe is due, the step thread launches the step
    as an ingest: no fence value (nothing on the GPU waits for the draft thread, which on the H200
    cost a target step about 1 ms of every 5 with speculation off), the rows still reach the server,
    and the controller counts the step as one it drafted nothing for."""
    speculator = _speculator(vllm_config, sim, ngram_server.address, monkeypatch, VLLM_K3_DRAFT_ADAPTIVE="on",
                             VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    a = [1, 2, 3, 1, 2]
    sim.add("a", a)
    pipe = speculator.core.session.pipeline
    ctl = pipe.controller
    ctl.acceptance.tried[:] = 1000.0                           # measured: every draft rejected,
    for tokens in (1, 2, 3, 4):                                # and what a step costs
        ctl.cost.observe(tokens, 0.010 + 0.001 * tokens)
    ctl._off, ctl._interval = 1, 10 ** 6                       # off, and no probe due for long
    seq = pipe._seq
    # every TP rank joins the same broadcasts whatever the driver decided (a DSpark server's confidence too)
    speculator._server_confidence = torch.full((speculator.max_num_reqs, K), -1.0)
    shapes = []
    monkeypatch.setattr(speculator.core.session, "broadcast", lambda t: shapes.append(tuple(t.shape)))
    d = sim.propose(speculator, [Sched("a", 0, a, sampled=3)])
    assert shapes == [(1, K), (1, K)]
    assert d.tolist() == [[3] * K]                             # no drafts: the last sampled token
    assert pipe._seq == seq                                    # no fence value: nothing waits
    speculator.flush()
    stats = server_stats(speculator)
    assert not stats["ops"].get("propose") and stats["ops"].get("ingest")
    assert ctl.counters["held_steps"] == 1 and ctl.counters["off_steps"] >= 1
    ctl._off, ctl._interval = 0, ctl.s.probe_interval         # speculation on again: the step asks
    sim.propose(speculator, [Sched("a", len(a), [3], sampled=1)])
    assert pipe._seq == seq + 1 and shapes[2:] == [(1, K), (1, K)]
    speculator.close()


def test_a_step_launched_while_the_fixed_slots_are_held_still_drafts(speculator, sim):
    """With async scheduling vLLM's host runs up to two steps ahead of the GPU, so both fixed launch
    slots are often still held when a step launches: the normal state, not a late server. Such a
    step takes a spill slot and still asks for its drafts (on the H200, skipping them cost a
    fixed K = 7 run at B = 32 a third of its accepted tokens); only the GPU deadline holds drafts back."""
    a = [1, 2, 3, 1, 2]
    sim.add("a", a)
    slots = speculator.slots
    held = [slots.acquire(0.0) for _ in range(slots.depth)]   # steps the draft thread has not finished,
    held.append(slots.acquire(0.0, rows=1))                   # the last of them in a spill slot already
    try:
        d = sim.propose(speculator, [Sched("a", 0, a, sampled=3)])
        assert slots.spills == 2
        assert d.tolist() == [expected_v2(a, 3)]
    finally:
        for i in held:
            slots.release(i)
    assert speculator.stats()["adapter"]["spill_slots"] == 2


def test_a_hung_draft_thread_never_holds_the_step(vllm_config, tp_group, ngram_server, sim, monkeypatch):
    """The draft thread hangs (a server that paused for a compile, a full staging ring): every step
    still returns, with no drafts, while it hangs — the fence by the GPU deadline, never the
    transport's 30 s (on the H200 this held vLLM's engine for 65 s). Steps past the launch slots
    spill into pinned memory sized to their rows and lose nothing (on the H200 a server answering
    late for a second disabled every request in flight, and their prefix-cache siblings for good);
    only past the spill budget does a step wait the same bound once and fail closed."""
    import threading
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch, VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="200",
                       VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS="600000")
    gate = threading.Event()
    opener = threading.Timer(60, gate.set)                    # a step that waited for the thread returns only after this
    opener.start()
    try:
        spec.core.session.pipeline.call(lambda c: gate.wait(), wait=False)    # the draft thread hangs
        drafts = []
        for i in range(4):                                    # more steps than launch slots
            rid, prompt = f"r{i}", [5, 6, 7, 5, 6 + i]
            sim.add(rid, prompt)
            drafts.append(sim.propose(spec, [Sched(rid, 0, prompt, sampled=9)]).tolist())
        assert not gate.is_set()                              # all four returned while it hung
        assert drafts == [[[9] * K]] * 4                       # no drafts: the last sampled token
        failed = lambda: spec.core.counters.get("failures.step_input", 0)   # noqa: E731
        assert failed() == 0 and spec.slots.spills >= 2        # past the slots: spilled, nothing lost
        for i in range(4):
            sim.remove(f"r{i}")
        n = 4
        while not failed() and n < 200:                       # until the spill budget is spent
            rid, prompt = f"r{n}", [5, 6, 7, 5, 6 + n % 50] * 24
            sim.add(rid, prompt)
            assert sim.propose(spec, [Sched(rid, 0, prompt, sampled=9)]).tolist() == [[9] * K]
            sim.remove(rid)
            n += 1
        assert failed() == 1 and spec.slots.spilled <= spec.slots.spill_cap
        assert not gate.is_set()                              # every one of them returned while it hung
    finally:
        opener.cancel()
        gate.set()
        spec.close()
