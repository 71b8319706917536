"""Off steps held from the launch on (V2, ``v2_held``), driven with vLLM 0.33's real V2 objects on CPU
against a real ngram draft server.

The rules a user relies on: while the adaptive controller keeps speculation off, an off step costs
the step thread a few launches and nothing reaches the server; the controller still counts every
such step; the first step that drafts again sees the whole context, in order (the ngram server's
drafts are prompt lookup over exactly what it was sent); a request vLLM dropped while its rows
were held never has them shipped; the step never reads device data on the host.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from helpers.standin import DeviceSim, own_buffers_as_device
from helpers.v2_sim import K, Sched, Sim, client_stats, expected_v2, server_stats

pytestmark = pytest.mark.vllm
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")


def _speculator(vllm_config, sim, address, monkeypatch):
    from k3_accel.vllm.spec_decode import hooks

    hooks.install_v2()
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", address)
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE", "on")
    monkeypatch.setenv("VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS", "20000")   # a CPU server on a busy box: not timing
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), sim.req_states)
    assert spec.hold is not None
    return spec


def _off(spec) -> None:
    """The controller has measured that no draft pays, and no probe is due for long. Its clock moves
    10 ms a reading, so every step costs the same whatever its tokens: no real timing."""
    ctl = spec.core.session.pipeline.controller
    ticks = itertools.count()
    ctl.clock = lambda: next(ticks) * 0.010
    ctl.acceptance.tried[:] = 1000.0
    for tokens in (1, 2, 3, 4):
        ctl.cost.observe(tokens, 0.010 + 0.001 * tokens)
    ctl._off, ctl._interval = 1, 10 ** 6


def _on(spec) -> None:
    ctl = spec.core.session.pipeline.controller
    ctl._off, ctl._interval = 0, ctl.s.probe_interval
    ctl.acceptance.tried[:] = ctl.acceptance.accepted[:] = 1000.0     # measured: every draft accepted


def _server_now(spec) -> dict:
    """The server's stats without handing over what the step thread holds (``server_stats`` flushes)."""
    return spec.core.session.pipeline.call(lambda c: c.server_stats())


def _no_failures(spec) -> None:
    """No request failed or was disabled on the client, and the adapter recorded no failure."""
    counters = client_stats(spec)["counters"]
    assert not {k: v for k, v in counters.items() if k.startswith("failures") or k == "disabled_requests"}
    assert not {k: v for k, v in spec.stats()["adapter"].items() if k.startswith("failures")}


@pytest.fixture
def speculator(vllm_config, tp_group, ngram_server, monkeypatch):
    sim = Sim()
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch)
    _off(spec)
    yield spec, sim
    spec.close()


def test_off_steps_reach_no_server_until_a_step_drafts_and_then_the_context_is_whole(speculator):
    spec, sim = speculator
    a, b = [7, 8, 9, 10, 11] * 3 + [1, 2], [1, 2, 3, 4, 1, 2, 3]
    sim.add("a", a, max_tokens=64)
    sim.add("b", b, max_tokens=64)
    sim.propose(spec, [Sched("a", 0, a[:10], next_prompt=a[10]), Sched("b", 0, b, sampled=4)], k=0)
    sim.propose(spec, [Sched("a", 10, a[10:], sampled=3), Sched("b", 7, [4], sampled=1)], k=0)
    ha, hb = a + [3], b + [4, 1]
    for t in range(6):                                 # plain decodes (the gate closed: K = 0)
        sa, sb = 20 + t, 30 + t
        sim.propose(spec, [Sched("a", len(ha) - 1, [ha[-1]], sampled=sa),
                           Sched("b", len(hb) - 1, [hb[-1]], sampled=sb)], k=0)
        ha.append(sa)
        hb.append(sb)
    held = 8
    assert spec.stats()["adapter"]["held_at_launch"] == held
    now = _server_now(spec)
    assert not now["ops"].get("ingest") and not now["ops"].get("propose") and now["ingested_rows"] == 0
    ctl = spec.core.session.pipeline.controller
    assert ctl.counters["held_steps"] == held           # the controller counted every one of them
    _on(spec)
    # the next step drafts: the held rows go first, merged, and the drafts see all of them
    d = sim.propose(spec, [Sched("a", len(ha) - 1, [ha[-1]], sampled=9),
                           Sched("b", len(hb) - 1, [hb[-1]], sampled=2)])
    assert d.tolist() == [expected_v2(ha, 9), expected_v2(hb, 2)]
    stats = server_stats(spec)
    assert stats["errors"] == {} and stats["ingested_rows"] == len(ha) + len(hb)
    assert stats["ops"]["ingest"] == 1                  # eight steps' rows in one ingest
    assert spec.stats()["adapter"]["held_regions"] == 1
    _no_failures(spec)


def test_a_step_verifying_drafts_is_launched_and_the_controller_learns_the_gpus_count(speculator):
    """The step thread can run ahead of the controller: a step it would hold may be verifying a
    probe's drafts. Only the GPU counts their accepted rows, and the controller must learn them: a
    step that verifies drafts is launched (after what is held, in order), never held."""
    spec, sim = speculator
    a = [4, 5, 6, 4, 5, 6, 4]
    sim.add("a", a, max_tokens=64)
    sim.propose(spec, [Sched("a", 0, a, sampled=5)], k=0)                      # held
    sim.propose(spec, [Sched("a", 7, [5], sampled=6)], k=K)                   # held (off)
    ctl = spec.core.session.pipeline.controller
    assert spec.stats()["adapter"]["held_at_launch"] == 2
    tried = ctl.acceptance.tried.copy()
    ctl.given = {"a": K}                                 # as if the last step had been a probe
    # its K drafts verified, the first accepted, 3 rejected
    sim.propose(spec, [Sched("a", 8, [6, 4, 1, 1, 1], sampled=7, rejected=3, drafts=4)], k=K)
    spec.flush()
    assert spec.stats()["adapter"]["held_at_launch"] == 2 and spec.stats()["adapter"]["held_regions"] == 1
    assert ctl.acceptance.tried[:2].tolist() == (tried[:2] * ctl.s.decay + 1).tolist()   # 1 accepted, 1 rejected
    history = a + [5, 6, 4]
    _on(spec)
    d = sim.propose(spec, [Sched("a", len(history), [7], sampled=5)])
    assert d.tolist() == [expected_v2(history + [7], 5)]
    assert server_stats(spec)["errors"] == {}
    _no_failures(spec)


def test_a_request_that_needs_its_history_is_launched_after_what_was_held(speculator):
    """A prefix-cache hit (its first rows start past 0) must bring its token history, which only the
    launch copies: that step is launched, after the held rows, in order."""
    spec, sim = speculator
    a, h = [1, 2, 3, 1, 2, 3, 1], [3, 1, 4, 1, 5, 9, 2, 6]
    sim.add("a", a, max_tokens=64)
    sim.propose(spec, [Sched("a", 0, a, sampled=2)], k=0)
    sim.add("h", h, max_tokens=64, num_computed=4)
    sim.propose(spec, [Sched("a", 7, [2], sampled=3), Sched("h", 4, h[4:], sampled=6)], k=0)
    adapter = spec.stats()["adapter"]
    assert adapter["held_at_launch"] == 1 and adapter["held_regions"] == 1
    _on(spec)
    d = sim.propose(spec, [Sched("a", 8, [3], sampled=1), Sched("h", 8, [6], sampled=3)])
    assert d.tolist() == [expected_v2(a + [2, 3], 1), expected_v2(h + [6], 3)]
    assert server_stats(spec)["errors"] == {}
    _no_failures(spec)


def test_rows_of_a_request_dropped_while_held_are_never_shipped(speculator):
    spec, sim = speculator
    a, b = [1, 2, 3, 1, 2, 3, 1], [9, 8, 9, 8]
    sim.add("a", a, max_tokens=64)
    sim.add("b", b, max_tokens=64)
    # b first in the batch: once it is dropped, a's rows are not where a compacted layout would put them
    sim.propose(spec, [Sched("b", 0, b, sampled=9), Sched("a", 0, a, sampled=2)], k=0)
    sim.propose(spec, [Sched("b", 4, [9], sampled=8), Sched("a", 7, [2], sampled=3)], k=0)
    sim.remove("b")                                    # finished: vLLM drops it from its request state
    sim.propose(spec, [Sched("a", 8, [3], sampled=1)], k=0)
    _on(spec)
    d = sim.propose(spec, [Sched("a", 9, [1], sampled=2)])
    history = a + [2, 3, 1]
    assert d.tolist() == [expected_v2(history, 2)]
    stats = server_stats(spec)
    assert stats["errors"] == {} and stats["ingested_rows"] == len(history)     # none of b's
    _no_failures(spec)


def test_a_full_region_goes_to_the_server_by_itself_and_the_next_one_fills(speculator):
    from k3_accel.vllm.spec_decode.v2_held import HOLD_STEPS

    spec, sim = speculator
    h = [3, 1, 4, 1, 5, 9, 2, 6]
    sim.add("a", h, max_tokens=200)
    sim.propose(spec, [Sched("a", 0, h, sampled=5)], k=0)
    h.append(5)
    for t in range(HOLD_STEPS + 5):
        s = 10 + t % 40
        sim.propose(spec, [Sched("a", len(h) - 1, [h[-1]], sampled=s)], k=0)
        h.append(s)
    assert spec.stats()["adapter"]["held_at_launch"] == HOLD_STEPS + 6
    assert spec.stats()["adapter"]["held_regions"] == 1          # the first region, full
    _on(spec)
    d = sim.propose(spec, [Sched("a", len(h) - 1, [h[-1]], sampled=7)])
    assert d.tolist() == [expected_v2(h, 7)]
    stats = server_stats(spec)
    assert stats["errors"] == {} and stats["ingested_rows"] == len(h)


def test_held_rows_reach_the_server_before_a_probe_falls_due(speculator):
    """A probe's drafts need every held row on the server first, and the GPU waits for them (at most
    the deadline: past it the probe drafts nothing). Far from a probe nothing is shipped; as one nears,
    what is held goes early, so the steps the probe waits for are few."""
    from k3_accel.vllm.spec_decode.v2_held import HAND_OVER_AHEAD, HAND_OVER_MIN, HOLD_STEPS

    spec, sim = speculator
    ctl, pipeline = spec.core.session.pipeline.controller, spec.core.session.pipeline
    h = [2, 7, 1, 8, 2, 8, 1, 8]
    sim.add("a", h, max_tokens=200)
    sim.propose(spec, [Sched("a", 0, h, sampled=4)], k=0)
    h.append(4)
    ctl._off, ctl._interval = 1, HAND_OVER_AHEAD + 6
    budgets, waiting, shipped = [], [], []
    while ctl.off_budget() > 0:                        # the gate is closed (K = 0) up to the probe
        s = 20 + len(h) % 30
        sim.propose(spec, [Sched("a", len(h) - 1, [h[-1]], sampled=s)], k=0)
        h.append(s)
        pipeline.call(lambda c: None)                 # the controller counted the step before the next
        budgets.append(ctl.off_budget())
        waiting.append(len(spec.hold))
        shipped.append(_server_now(spec)["ingested_rows"])
    # the step thread reads the budget before or after the draft thread counted the step it holds
    far = [i for i, b in enumerate(budgets) if b >= HAND_OVER_AHEAD]
    near = [i for i, b in enumerate(budgets) if b < HAND_OVER_AHEAD - 1]
    assert far and near and len(budgets) < HOLD_STEPS    # one region would hold every step
    assert all(shipped[i] == 0 for i in far)           # far from a probe: nothing shipped
    assert max(waiting[i] for i in near) < HAND_OVER_MIN
    assert shipped[-1] >= len(h) - 1 - HAND_OVER_MIN    # the rows the probe waits for: a few steps'
    _on(spec)
    d = sim.propose(spec, [Sched("a", len(h) - 1, [h[-1]], sampled=5)])
    assert d.tolist() == [expected_v2(h, 5)]
    assert server_stats(spec)["errors"] == {}
    _no_failures(spec)


def test_a_held_step_never_reads_device_data_on_the_host(vllm_config, tp_group, ngram_server, monkeypatch):
    sim = DeviceSim()
    spec = _speculator(vllm_config, sim, ngram_server.address, monkeypatch)
    try:
        own_buffers_as_device(spec)
        _off(spec)
        a = [7, 8, 9, 10, 11] * 3 + [1, 2, 3]
        sim.add("a", a, max_tokens=64)
        sim.propose(spec, [Sched("a", 0, a, sampled=7)], k=0)
        sim.propose(spec, [Sched("a", len(a), [7], sampled=8)], k=0)
        assert spec.stats()["adapter"]["held_at_launch"] == 2
        _on(spec)
        d = sim.propose(spec, [Sched("a", len(a) + 1, [8], sampled=7)])
        assert d.tolist() == [expected_v2(a + [7, 8], 7)]
        _no_failures(spec)
        assert server_stats(spec)["errors"] == {}
    finally:
        spec.close()


def test_a_request_preempted_and_resumed_while_its_rows_are_held_drafts_from_its_new_rows(speculator):
    """vLLM's V2 runner drops a preempted request (it is freed on the server at the next step) and adds
    it again, same id, when it resumes. Rows held from before its preemption belong to the context the
    free ended: they are never shipped after the free, and the resumed request drafts from its new rows."""
    spec, sim = speculator
    a, b = [1, 2, 3, 1, 2, 3, 1], [9, 8, 7, 9, 8, 7, 9, 8]
    sim.add("a", a, max_tokens=64)
    sim.add("b", b, max_tokens=64)
    sim.propose(spec, [Sched("a", 0, a, sampled=2), Sched("b", 0, b, sampled=7)], k=0)
    spec.flush()                                       # the prompts are on the server
    sim.propose(spec, [Sched("a", 7, [2], sampled=3), Sched("b", 8, [7], sampled=9)], k=0)     # held
    sim.remove("b")                                    # preempted: vLLM drops it (freed at this step)
    sim.propose(spec, [Sched("a", 8, [3], sampled=1)], k=0)
    hb = b + [7, 9]
    sim.add("b", hb, max_tokens=64)                    # resumed: recomputed from its first token
    sim.propose(spec, [Sched("a", 9, [1], sampled=2), Sched("b", 0, hb[:9], next_prompt=hb[9])], k=0)
    assert spec.stats()["adapter"]["held_at_launch"] == 4
    _on(spec)
    d = sim.propose(spec, [Sched("a", 10, [2], sampled=3), Sched("b", 9, hb[9:], sampled=8)])
    assert d.tolist() == [expected_v2(a + [2, 3, 1, 2], 3), expected_v2(hb, 8)]
    assert server_stats(spec)["errors"] == {}
    _no_failures(spec)


def test_held_steps_that_cannot_be_handed_over_fail_closed_and_are_counted(speculator, monkeypatch):
    """Handing the held rows to the draft thread runs in the driver's step: a failure there must not
    raise into vLLM (with TP, the other ranks would wait in the drafts' broadcast); it is counted and
    the step goes on (its requests see a gap: no drafts, never wrong ones)."""
    spec, sim = speculator
    a = [4, 5, 6, 4, 5, 6, 4]
    sim.add("a", a, max_tokens=64)
    sim.propose(spec, [Sched("a", 0, a, sampled=5)], k=0)                      # held
    assert spec.stats()["adapter"]["held_at_launch"] == 1

    def take(live):
        raise RuntimeError("planted: the held region could not be taken")
    monkeypatch.setattr(spec.hold, "take", take)
    _on(spec)
    d = sim.propose(spec, [Sched("a", 7, [5], sampled=6)])
    assert d.tolist() == [[6] * K]                                             # no drafts: the filler
    assert spec.stats()["adapter"]["failures.step_input"] == 1
