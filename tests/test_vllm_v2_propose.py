"""``RemoteSpeculatorV2.propose`` driven like vLLM's V2 runner, against a real ngram draft server.

The speculator is built by the wrapped ``init_speculator`` from a real
``VllmConfig`` (dflash, K=4) in a real single-rank vLLM TP group (gloo);
``propose`` gets vLLM's own ``InputBatch`` / ``RequestState`` objects on the
CPU (see ``helpers.v2_sim``). The server is ``k3-draft-server --engine
ngram``, so the right drafts are prompt lookup over what the server was sent
(``expected``); the runner sees them with "no draft" (-1) replaced by the
request's last sampled token (``expected_v2``, ``filled``).
"""
from __future__ import annotations

import pytest
import torch

from helpers.v2_sim import K, Sched, Sim, client_stats, expected, expected_v2, filled, server_stats

pytestmark = pytest.mark.vllm
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")


@pytest.fixture
def sim():
    return Sim()


@pytest.fixture
def speculator(vllm_config, tp_group, ngram_server, sim, monkeypatch):
    from k3_accel.vllm.spec_decode import hooks

    hooks.install_v2()
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", ngram_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE", "off")         # a fixed K: these tests check exact drafts
    monkeypatch.setenv("VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS", "20000")   # (a CPU server on a busy box: not timing)
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), sim.req_states)
    assert type(spec).__name__ == "RemoteSpeculatorV2"
    yield spec
    spec.close()


def counters(spec) -> dict:
    return client_stats(spec)["counters"]


def rows(drafts: torch.Tensor) -> list[list[int]]:
    return drafts.tolist()


# ------------------------------------------------------------------ drafts
def test_drafts_are_prompt_lookup_over_valid_rows(speculator, sim):
    a = [7, 8, 9, 10, 11] * 3 + [1, 2, 3]
    b = [1, 2, 3, 4, 1, 2, 3]
    sim.add("a", a)
    sim.add("b", b)
    d = sim.propose(speculator, [Sched("a", 0, a, sampled=7), Sched("b", 0, b, sampled=4)])
    assert d.dtype == torch.int64 and tuple(d.shape) == (2, K) and d.device.type == "cpu"
    assert rows(d) == [expected_v2(a, 7), expected_v2(b, 4)]
    # verify step: a accepts 2 of its 4 drafts (rows 18..22, last 2 rejected), b accepts none;
    # the rejected drafts (99s) must not reach the server, the bonus tokens are the anchors
    d = sim.propose(speculator, [Sched("a", 18, [7, 8, 9, 99, 99], sampled=5, rejected=2, drafts=4),
                                 Sched("b", 7, [4, 99, 99, 99, 99], sampled=2, rejected=4, drafts=4)])
    assert rows(d) == [expected_v2(a + [7, 8, 9], 5), expected_v2(b + [4], 2)]
    stats = server_stats(speculator)
    assert stats["errors"] == {} and stats["ingested_rows"] == len(a) + len(b) + 3 + 1
    assert speculator.stats()["adapter"]["steps"] == 2


def test_mid_prefill_step_is_deferred_and_the_final_chunk_proposes(speculator, sim):
    p = [5, 6, 7, 8] * 10
    sim.add("p", p)
    d = sim.propose(speculator, [Sched("p", 0, p[:24], next_prompt=p[24])])
    assert rows(d) == [[0] * K]                     # no draft: the slot's last sampled token (none yet: 0)
    c = counters(speculator)
    assert c.get("deferred_ingests") == 1 and not c.get("sync_proposals")
    d = sim.propose(speculator, [Sched("p", 24, p[24:], sampled=5)])
    assert rows(d) == [expected_v2(p, 5)]
    assert counters(speculator)["sync_proposals"] == 1
    stats = server_stats(speculator)
    assert stats["ops"]["ingest"] == 1 and stats["ops"]["propose"] == 1 and stats["ingested_rows"] == 40


def test_a_mixed_batch_splits_ingest_and_propose(speculator, sim):
    a, b = [3, 4, 5, 3, 4], [9, 9, 8, 9, 9, 8, 9]
    sim.add("a", a)
    sim.add("b", b)
    d = sim.propose(speculator, [Sched("a", 0, a, sampled=5), Sched("b", 0, b[:4], next_prompt=b[4])])
    assert rows(d) == [expected_v2(a, 5), [0] * K]
    d = sim.propose(speculator, [Sched("a", 5, [5], sampled=3), Sched("b", 4, b[4:], sampled=9)])
    assert rows(d) == [expected_v2(a + [5], 3), expected_v2(b, 9)]


def test_k_zero_still_ships_context(speculator, sim):
    q = [2, 4, 6, 8, 2, 4]
    sim.add("q", q)
    d = sim.propose(speculator, [Sched("q", 0, q, sampled=6)], k=0)   # scheduler's skip_drafts
    assert tuple(d.shape) == (1, K) and rows(d) == [[-1] * K]          # full width: the runner writes [:, 0:]
    stats = server_stats(speculator)
    assert stats["ingested_rows"] == len(q) and not stats["ops"].get("propose")
    d = sim.propose(speculator, [Sched("q", 6, [6], sampled=8)])
    assert rows(d) == [expected_v2(q + [6], 8)]                        # the K=0 rows were used


def test_fewer_drafts_than_configured(speculator, sim):
    """Two requests (the reply's first k columns are then not one dense block), k = 2 of 4."""
    q, w = [1, 2, 3, 1, 2, 3, 1], [4, 5, 6, 4, 5]
    sim.add("q", q)
    sim.add("w", w)
    d = sim.propose(speculator, [Sched("q", 0, q, sampled=2), Sched("w", 0, w, sampled=6)], k=2)   # dynamic K
    assert rows(d) == [expected_v2(q, 2, k=2) + [-1] * (K - 2), expected_v2(w, 6, k=2) + [-1] * (K - 2)]


def test_a_step_scheduled_fewer_drafts_asks_the_server_for_the_whole_block(speculator, sim, monkeypatch):
    """vLLM's scheduler may schedule fewer drafts than K for a step (a K per batch size). In-tree
    DFlash still drafts its whole block (its drafts depend on the block) and the runner blanks the
    columns past the step's K; asked for the smaller K, the server drafted another block, and captured
    CUDA graphs for that K on first use, mid-run. The server is asked for K; vLLM gets the first
    drafts, the rest -1."""
    from k3_accel.transport.client import DraftClient

    asked = []
    step = DraftClient.step

    def spy(self, inp):
        asked.append(inp.k)
        return step(self, inp)
    monkeypatch.setattr(DraftClient, "step", spy)
    q = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    sim.add("q", q)
    d = sim.propose(speculator, [Sched("q", 0, q, sampled=6)], k=2)
    assert asked == [K]
    assert rows(d) == [expected_v2(q, 6, k=K)[:2] + [-1] * (K - 2)]


def test_dummy_and_profile_runs_send_nothing(speculator, sim):
    before = {k: v for k, v in server_stats(speculator)["ops"].items() if k != "stats"}
    msgs = counters(speculator)
    d = sim.dummy_propose(speculator, num_reqs=4, num_tokens=64)
    assert tuple(d.shape) == (4, K) and rows(d) == [[-1] * K] * 4
    sim.dummy_propose(speculator, num_reqs=2, num_tokens=512, is_profile=True, skip_attn_for_dummy_run=True)
    sim.add("x", [1, 2, 3])
    sim.propose(speculator, [Sched("x", 0, [1, 2, 3], sampled=1)], is_profile=True)
    after = {k: v for k, v in server_stats(speculator)["ops"].items() if k != "stats"}
    assert after == before
    assert counters(speculator) == msgs
    assert speculator.stats()["adapter"]["dummy_runs"] == 3


def test_the_step_threads_host_time_is_one_phase_per_real_step(speculator, sim):
    """What the plugin adds to vLLM's step thread: every real propose call (an off step's too) is one
    ``v2.propose`` in the driver's phases; dummy and profile runs are not counted."""
    a = [5, 6, 7, 5, 6]
    sim.add("a", a)
    sim.dummy_propose(speculator, num_reqs=2, num_tokens=16)
    sim.propose(speculator, [Sched("a", 0, a, sampled=7)], k=0)
    sim.propose(speculator, [Sched("a", 5, [7], sampled=5)], k=0)
    sim.propose(speculator, [Sched("a", 6, [5], sampled=6)])
    phase = client_stats(speculator)["phases"].get("v2.propose")
    assert phase is not None and phase["count"] == 3, phase
    assert phase["mean_ms"] > 0


# ------------------------------------------------------- max_tokens <= 1
def test_a_batch_of_max_tokens_one_requests_does_no_remote_work(speculator, sim):
    sim.add("one", [1, 2, 3, 4], max_tokens=1)
    sim.add("two", [5, 6, 7], max_tokens=1)
    before = {k: v for k, v in server_stats(speculator)["ops"].items() if k != "stats"}
    # vLLM's scheduler marks this step skip_drafts, so V2 passes num_speculative_tokens=0
    d = sim.propose(speculator, [Sched("one", 0, [1, 2, 3, 4], sampled=9), Sched("two", 0, [5, 6, 7], sampled=9)],
                    k=0)
    assert rows(d) == [[-1] * K] * 2
    assert {k: v for k, v in server_stats(speculator)["ops"].items() if k != "stats"} == before
    assert speculator.stats()["adapter"]["skipped_steps"] == 1
    # ... and nothing to free when they finish
    sim.remove("one")
    sim.remove("two")
    sim.add("z", [4, 4, 4])
    sim.propose(speculator, [Sched("z", 0, [4, 4, 4], sampled=4)])
    assert not server_stats(speculator)["ops"].get("free")


def test_max_tokens_one_requests_are_left_out_of_a_mixed_step(speculator, sim):
    long = [1, 2, 3, 4, 1, 2, 3]
    sim.add("one", [8, 8, 8, 8], max_tokens=1)
    sim.add("long", long)
    d = sim.propose(speculator, [Sched("one", 0, [8, 8, 8, 8], sampled=8), Sched("long", 0, long, sampled=4)])
    assert rows(d) == [[8] * K, expected_v2(long, 4)]             # "one" gets no draft (filled)
    stats = server_stats(speculator)
    assert stats["ingested_rows"] == len(long) and stats["proposals"] == 1
    assert speculator.stats()["adapter"]["skipped_requests"] == 1


@pytest.mark.vllm033
def test_vllms_scheduler_already_skips_drafts_for_max_tokens_one():
    """What 0.33's scheduler does on its own: such a request's drafts are unused (-> skip_drafts, K=0)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    drafts_unused = Scheduler._drafts_unused
    one = Request(request_id="one", prompt_token_ids=[1, 2, 3, 4], sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None)
    many = Request(request_id="many", prompt_token_ids=[1, 2, 3, 4], sampling_params=SamplingParams(max_tokens=8),
                   pooling_params=None)
    assert drafts_unused(None, one, 0, 4) is True
    assert drafts_unused(None, many, 0, 4) is False
    assert drafts_unused(None, many, 0, 2) is True                 # non-final prefill chunk


# ------------------------------------------------------ request lifecycle
def test_requests_vllm_removed_are_freed_on_the_next_step(speculator, sim):
    f = [3, 1, 4, 1, 5, 9, 2, 6]
    sim.add("f", f)
    sim.propose(speculator, [Sched("f", 0, f, sampled=5)])
    assert server_stats(speculator)["active"] == 1
    sim.remove("f")                                  # finished (or preempted) in vLLM
    sim.add("g", [1, 1, 2])
    sim.propose(speculator, [Sched("g", 0, [1, 1, 2], sampled=1)])
    stats = server_stats(speculator)
    assert stats["ops"]["free"] == 1 and stats["active"] == 1      # f gone (retained for reconnects), g live
    assert speculator.stats()["adapter"]["known_requests"] == 1


def test_prefix_cache_hit_gets_its_prompt_from_request_state(speculator, sim):
    shared = [10, 11, 12, 13, 14, 15, 16, 17]
    first = shared + [20, 21]
    sim.add("r1", first)
    sim.propose(speculator, [Sched("r1", 0, first, sampled=22)])
    sim.remove("r1")
    second = shared + [30, 10, 11]
    sim.add("r2", second, num_computed=8)            # vLLM's prefix cache covers the first 8 tokens
    d = sim.propose(speculator, [Sched("r2", 8, second[8:], sampled=12)])
    assert rows(d) == [expected_v2(second, 12)]
    c = counters(speculator)
    assert c.get("reconnects", 0) + c.get("cold_starts", 0) >= 1 and not c.get("failures.cold_start")


# ---------------------------------------------------------- fail closed
def test_a_bad_step_input_fails_closed(speculator, sim):
    sim.add("w", [1, 2, 3, 1, 2])
    sim.hidden_dtype = torch.float32                 # the target would ship bf16: refused at launch
    d = sim.propose(speculator, [Sched("w", 0, [1, 2, 3, 1, 2], sampled=3)])
    assert rows(d) == [[3] * K]                                        # no draft
    assert speculator.stats()["adapter"]["failures.step_input"] == 1
    assert not server_stats(speculator)["ops"].get("propose")


def test_a_dead_server_fails_closed(speculator, sim, ngram_server):
    a = [1, 2, 1, 2, 1]
    sim.add("a", a)
    assert rows(sim.propose(speculator, [Sched("a", 0, a, sampled=2)])) == [expected_v2(a, 2)]
    ngram_server.stop()
    d = sim.propose(speculator, [Sched("a", 5, [2], sampled=1)])
    assert rows(d) == [[1] * K]                                        # no draft
    ngram_server.proc.returncode = 0                 # the fixture's teardown asserts a clean exit


def test_a_closed_speculator_gives_no_drafts(speculator, sim):
    speculator.close()
    sim.add("a", [1, 2, 1])
    assert rows(sim.propose(speculator, [Sched("a", 0, [1, 2, 1], sampled=2)])) == [[2] * K]


def test_an_inconsistent_batch_fails_closed_before_the_transport(speculator, sim):
    sim.add("v", [1, 2, 3])
    # every row of the block "rejected": no valid context row, nothing can be shipped
    d = sim.propose(speculator, [Sched("v", 0, [1, 2, 3], sampled=1, rejected=3, drafts=3)])
    assert rows(d) == [[1] * K]
    assert speculator.stats()["adapter"]["failures.step_input"] == 1
    assert not server_stats(speculator)["ops"].get("ingest")


def test_no_draft_never_reaches_the_runner_as_minus_one(speculator, sim):
    """vLLM's V2 runner writes drafts into the next step's input_ids unchecked; -1 would crash the embedding."""
    a = [1, 2, 3, 4, 5]                                  # no repeated n-gram: the server finds nothing
    sim.add("a", a)
    sim.add("b", [6, 7, 6, 7, 6])
    d = sim.propose(speculator, [Sched("a", 0, a, sampled=9), Sched("b", 0, [6, 7, 6, 7, 6], sampled=7)])
    assert expected([1, 2, 3, 4, 5], 9) == [-1] * K      # the server's answer for a: no draft at all
    assert rows(d) == [[9] * K, filled(expected([6, 7, 6, 7, 6], 7), 7)]
    assert (d >= 0).all()
    speculator.fill_missing_drafts = False               # the raw drafts, for comparison
    raw = sim.propose(speculator, [Sched("a", 5, [9], sampled=8), Sched("b", 5, [7], sampled=6)])
    assert rows(raw) == [expected(a + [9], 8), expected([6, 7, 6, 7, 6, 7], 6)] and rows(raw)[0] == [-1] * K
