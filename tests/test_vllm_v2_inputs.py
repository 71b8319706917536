"""The V2 adapter's translation of ``propose(...)`` arguments (no server): vLLM's own
``InputBatch`` / ``RequestState`` on CPU (:mod:`helpers.v2_sim`) -> ``StepInput``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.v2_sim import AUX_LAYERS, HIDDEN, K, MAX_TOKENS, Sched, Sim
from k3_accel.vllm.spec_decode import v2, v2_launch

pytestmark = pytest.mark.vllm


@pytest.fixture
def sim():
    pytest.importorskip("vllm.v1.worker.gpu.input_batch")
    return Sim()


def _build(sim: Sim, sched, keep=None, k=K, history=None):
    """``launch`` + ``step_input``, as the driver's step thread and draft thread run them."""
    ib, aux, num_sampled, num_rejected = sim.batch(sched)
    keep = np.arange(len(sched)) if keep is None else np.asarray(keep)
    rs = sim.req_states
    rows = v2_launch.DeviceRows(MAX_TOKENS, HIDDEN * len(AUX_LAYERS), torch.bfloat16, sim.max_num_reqs,
                                torch.device("cpu"))
    slots = v2_launch.LaunchSlots(2, MAX_TOKENS, HIDDEN * len(AUX_LAYERS), torch.bfloat16, sim.max_num_reqs,
                                  pin=False)
    step = v2_launch.launch(rows, slots, ib, aux, num_sampled, num_rejected, rs.last_sampled_tokens,
                            rs.next_prefill_tokens, keep, k, v2.history_rows(ib, keep, history or ()),
                            rs.all_token_ids.gpu, 1.0)
    step.wait_ready()
    try:
        return step.step_input()
    finally:
        step.release()


def test_valid_rows_anchors_and_hidden_follow_vllms_dflash_rule(sim):
    sim.add("dec", list(range(10, 20)))
    sim.add("pre", list(range(30, 50)))
    sim.add("new", [5, 6, 7])
    sched = [
        # verify block at 10..14: token 19 + 4 drafts; 3 drafts rejected -> rows 10, 11 valid
        Sched("dec", 10, [19, 100, 101, 102, 103], sampled=77, rejected=3, drafts=4),
        # mid-prefill chunk 0..7: nothing sampled; anchor = next prompt token (38) at 8
        Sched("pre", 0, list(range(30, 38)), next_prompt=38),
        Sched("new", 0, [5, 6, 7], sampled=8),
    ]
    inp = _build(sim, sched)
    assert inp.req_ids == ["dec", "pre", "new"]
    assert inp.counts == [2, 8, 3]
    assert inp.sampled == [True, False, True]
    assert inp.positions.tolist() == [10, 11, *range(0, 8), 0, 1, 2]
    assert inp.token_ids.tolist() == [19, 100, *range(30, 38), 5, 6, 7]
    assert inp.anchor_tokens.tolist() == [77, 38, 8]
    assert inp.anchor_positions.tolist() == [12, 8, 3]
    # aux hidden states of the valid rows only, layers concatenated on the last dim in vLLM's order
    assert inp.hidden.shape == (13, HIDDEN * len(AUX_LAYERS)) and inp.hidden.dtype == torch.bfloat16
    want = torch.stack([torch.cat([Sim.aux_row(int(p), j) for j in range(len(AUX_LAYERS))])
                        for p in inp.positions]).to(torch.bfloat16)
    assert torch.equal(inp.hidden, want)
    assert inp.k == K and inp.prompt_token_ids is None
    assert inp.num_verified[0] == 4                   # the verify block ran all four drafts (rows run - 1)


def test_skipped_requests_and_history_of_prefix_cache_hits(sim):
    sim.add("a", [1, 2, 3, 4])
    sim.add("b", [9, 8, 7, 6, 5, 4], num_computed=4)    # prefix-cache hit: rows start at 4
    sim.add("c", [3, 3, 3])
    sched = [Sched("a", 0, [1, 2, 3, 4], sampled=5), Sched("b", 4, [5, 4], sampled=1),
             Sched("c", 0, [3, 3, 3], sampled=3)]
    inp = _build(sim, sched, keep=[1, 2], history=["b", "c"])
    assert inp.req_ids == ["b", "c"] and inp.counts == [2, 3]
    assert inp.positions.tolist() == [4, 5, 0, 1, 2] and inp.token_ids.tolist() == [5, 4, 3, 3, 3]
    assert inp.anchor_positions.tolist() == [6, 3]
    # the tokens before its first row; c starts at 0 and needs none
    assert list(inp.prompt_token_ids) == ["b"] and inp.prompt_token_ids["b"].tolist() == [9, 8, 7, 6]
    inp = _build(sim, sched, keep=[1], history=["c"])
    assert inp.prompt_token_ids is None                  # only for requests the transport asked about


def test_a_skipped_request_in_the_middle_leaves_no_row(sim):
    sim.add("x", [1, 2, 3])
    sim.add("y", [4, 5])
    sim.add("z", [6, 7, 8, 9])
    sched = [Sched("x", 3, [4, 9, 9], sampled=1, rejected=2, drafts=2), Sched("y", 0, [4, 5], sampled=6),
             Sched("z", 0, [6, 7, 8, 9], sampled=2)]
    inp = _build(sim, sched, keep=[0, 2])
    assert inp.req_ids == ["x", "z"] and inp.counts == [1, 4]
    assert inp.token_ids.tolist() == [4, 6, 7, 8, 9] and inp.positions.tolist() == [3, 0, 1, 2, 3]


def test_max_tokens_one_is_found_from_request_state(sim):
    sim.add("one", [1, 2, 3], max_tokens=1)
    sim.add("many", [1, 2, 3], max_tokens=2)
    ib, *_ = sim.batch([Sched("one", 0, [1, 2, 3], sampled=1), Sched("many", 0, [1, 2, 3], sampled=1)])
    assert v2.skip_mask(ib, sim.req_states).tolist() == [True, False]
    assert v2.skip_mask(ib, None).tolist() == [False, False]


def test_a_block_with_no_valid_row_is_an_error(sim):
    sim.add("z", [1, 2])
    with pytest.raises(ValueError, match="no valid context row"):
        _build(sim, [Sched("z", 0, [1, 2], sampled=3, rejected=2, drafts=2)])


def test_trimmed_verification_rows_past_the_device_end_are_ignored(sim):
    """With vLLM's adaptive verification the host's query_start_loc is an upper bound (the device's
    is rewritten): padding rows past the device's end never become context."""
    import dataclasses
    sim.add("t", list(range(1, 10)))
    ib, aux, ns, nr = sim.batch([Sched("t", 5, [6, 50, 51], sampled=7, rejected=1, drafts=2)])
    pad = 3                                               # the host thinks 3 more rows were scheduled
    ib = dataclasses.replace(
        ib, query_start_loc_np=ib.query_start_loc_np + np.array([0, pad], dtype=np.int32),
        input_ids=torch.cat([ib.input_ids, torch.full((pad,), 99, dtype=ib.input_ids.dtype)]),
        positions=torch.cat([ib.positions, torch.arange(8, 8 + pad)]))
    aux = [torch.cat([a, torch.full((pad, a.shape[1]), -7.0, dtype=a.dtype)]) for a in aux]
    rs = sim.req_states
    rows = v2_launch.DeviceRows(MAX_TOKENS, HIDDEN * len(AUX_LAYERS), torch.bfloat16, sim.max_num_reqs,
                                torch.device("cpu"))
    slots = v2_launch.LaunchSlots(2, MAX_TOKENS, HIDDEN * len(AUX_LAYERS), torch.bfloat16, sim.max_num_reqs,
                                  pin=False)
    step = v2_launch.launch(rows, slots, ib, aux, ns, nr, rs.last_sampled_tokens, rs.next_prefill_tokens,
                            np.arange(1), K, {}, None, 1.0)
    inp = step.step_input()
    assert inp.counts == [2] and inp.token_ids.tolist() == [6, 50] and inp.positions.tolist() == [5, 6]
    assert not (inp.hidden == -7.0).any() and inp.anchor_positions.tolist() == [7]
    assert inp.num_verified == [2]                    # what the device ran, not the host's upper bound


# ------------------------------------------------- the device plane's ring (the launch's side of it)
def _launch(sim: Sim, sched, ring=None, capacity=MAX_TOKENS):
    ib, aux, num_sampled, num_rejected = sim.batch(sched)
    rs = sim.req_states
    width = HIDDEN * len(AUX_LAYERS)
    rows = v2_launch.DeviceRows(capacity, width, torch.bfloat16, sim.max_num_reqs, torch.device("cpu"))
    slots = v2_launch.LaunchSlots(2, capacity, width, torch.bfloat16, sim.max_num_reqs, pin=False)
    step = v2_launch.launch(rows, slots, ib, aux, num_sampled, num_rejected, rs.last_sampled_tokens,
                            rs.next_prefill_tokens, np.arange(len(sched)), K, {}, None, 1.0, ring=ring)
    step.wait_ready()
    return step


def _mixed(sim: Sim):
    sim.add("dec", list(range(10, 20)))
    sim.add("pre", list(range(30, 50)))
    return [Sched("dec", 10, [19, 100, 101, 102, 103], sampled=77, rejected=3, drafts=4),
            Sched("pre", 0, list(range(30, 38)), next_prompt=38)]


def test_a_launch_on_the_device_plane_names_its_ring_slot_with_the_host_paths_rows(sim):
    from helpers.standin import host_ring
    sched = _mixed(sim)
    want = _launch(sim, sched).step_input()
    ring = host_ring(2, 16, HIDDEN * len(AUX_LAYERS))
    steps = [_launch(sim, sched, ring) for _ in range(2)]
    inps = [s.step_input() for s in steps]
    # each step's rows are a view of its own slot, from its first row: the transport names the slot
    assert [ring.slot_of(i.hidden) for i in inps] == [(0, 0), (1, 0)]
    for inp in inps:
        assert torch.equal(inp.hidden, want.hidden) and inp.counts == want.counts
        assert inp.token_ids.tolist() == want.token_ids.tolist()
    assert ring.holds == [1, 1]                   # each held by its launch until the draft thread is done
    for s in steps:
        s.release()
        s.release()                               # idempotent: a hold is given back once
    assert ring.holds == [0, 0]


def test_a_slot_the_server_may_still_be_reading_is_never_written(sim):
    """A hold that went without a reply (the link failed) leaves a slot whose last read may still
    be running: the launch takes another slot, or the host path, and never waits for the server's
    event (a dead server's event never completes)."""
    from helpers.standin import ServerEvent, host_ring
    sched = _mixed(sim)
    want = _launch(sim, sched).step_input()
    ring = host_ring(2, 16, HIDDEN * len(AUX_LAYERS))
    ring.released = [ServerEvent(False), ServerEvent(True)]
    first = _launch(sim, sched, ring)
    assert first.ring_slot == 1                   # slot 0's read is not known complete
    second = _launch(sim, sched, ring)
    assert second.ring_slot is None and torch.equal(second.step_input().hidden, want.hidden)
    for s in (first, second):
        s.release()
    ring.released[0] = ServerEvent(False, gone=True)     # its server's context died: not waited on
    third = _launch(sim, sched, ring)
    assert third.ring_slot == 0 and ring.released[0] is None
    assert torch.equal(third.step_input().hidden, want.hidden)
    third.release()
    assert ring.holds == [0, 0]


def test_no_free_slot_or_too_many_rows_takes_the_host_path_at_once(sim):
    from helpers.standin import host_ring
    sched = _mixed(sim)
    want = _launch(sim, sched).step_input()
    ring = host_ring(2, 16, HIDDEN * len(AUX_LAYERS))
    ring.hold(0)                                  # a message in flight still names the next slot:
    other = _launch(sim, sched, ring)             # the one after it is taken
    assert other.ring_slot == 1 and ring.holds == [1, 1]
    busy = _launch(sim, sched, ring)              # every slot named: this step does not wait for one
    inp = busy.step_input()
    assert busy.ring_slot is None and ring.slot_of(inp.hidden) is None and ring.holds == [1, 1]
    assert torch.equal(inp.hidden, want.hidden)   # the same rows, through pinned memory
    busy.release()
    other.release()
    ring.release(0)
    assert ring.holds == [0, 0]
    small = host_ring(2, 12, HIDDEN * len(AUX_LAYERS))     # the step runs 13 rows: more than a slot holds
    big = _launch(sim, sched, small)
    assert big.ring_slot is None and torch.equal(big.step_input().hidden, want.hidden)
    big.release()
    assert small.holds == [0, 0]
