"""DraftClient against a real ngram draft server (subprocess, real ZMQ sockets)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers.oracles import ngram_lookup as lookup
from helpers.server import ServerProcess
from helpers.steps import drafts_again, step as rows
from k3_accel.transport.api import StepInput
from k3_accel.transport.failures import StepInputError

K = 4
BIG = 40_000           # rows: more than a 1 MiB ngram pool holds (32 B/row -> 32768 rows)


def expected_drafts(history: list[int], anchor: int, k: int = K) -> list[int]:
    found = lookup([*history, anchor], k)
    return found + [-1] * (k - len(found))


@pytest.fixture
def small_server():
    """A server whose context pool (1 MiB) cannot hold BIG rows for one request."""
    srv = ServerProcess("--engine", "ngram", "--memory-budget-mb", "1")
    yield srv
    srv.stop()


def test_deferred_ingests_then_propose_are_processed_in_order(server, client_factory, monkeypatch):
    client = client_factory(server.address, ring_depth=4)
    original = client.link.conn.post

    def slow_post(*args, **kwargs):          # a sender thread that lags behind the target's thread
        if threading.current_thread().name == "k3-draft-sender":
            time.sleep(0.3)
        return original(*args, **kwargs)
    monkeypatch.setattr(client.link.conn, "post", slow_post)
    history = [7, 8, 9, 10, 11] * 30 + [1, 2, 3]
    first, second, last = history[:60], history[60:120], history[120:]
    out1 = client.step(rows(["a"], [(0, first)], sampled=[False]))
    out2 = client.step(rows(["a"], [(60, second)], sampled=[False]))
    assert out1.deferred and out2.deferred                        # returned without waiting
    out3 = client.step(rows(["a"], [(120, last)], anchors=[7]))
    assert not out3.deferred
    # the drafts can only be right if the server stored all 153 rows, in order, before proposing
    assert out3.drafts.tolist() == [expected_drafts(history, 7)]
    stats = client.server_stats()
    assert stats["ops"]["ingest"] == 2 and stats["ops"]["propose"] == 1 and stats["errors"] == {}
    assert stats["ingested_rows"] == len(history)
    counters = client.stats()["counters"]
    assert counters["deferred_ingests"] == 2 and counters["sync_proposals"] == 1


def test_mixed_step_splits_ingest_and_propose(server, client_factory):
    client = client_factory(server.address)
    a_hist, b_hist = [5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3]
    # b is still mid-prefill (did not sample): it must not be drafted for
    out = client.step(rows(["a", "b"], [(0, a_hist), (0, b_hist[:4])], sampled=[True, False], anchors=[7, 1]))
    assert out.drafts[0].tolist() == expected_drafts(a_hist, 7)
    assert out.drafts[1].tolist() == [-1] * K
    out = client.step(rows(["b", "a"], [(4, b_hist[4:]), (5, [7])], anchors=[4, 5]))
    assert out.drafts[0].tolist() == expected_drafts(b_hist, 4)
    assert out.drafts[1].tolist() == expected_drafts(a_hist + [7], 5)
    stats = client.server_stats()
    assert stats["proposals"] == 3 and stats["errors"] == {}


def test_anchor_tensors_work_like_lists(server, client_factory):
    client = client_factory(server.address)
    inp = rows(["a"], [(0, [5, 6, 7, 5, 6])], anchors=[7])
    inp.anchor_tokens, inp.anchor_positions = torch.tensor([7]), torch.tensor([5])
    assert client.step(inp).drafts[0].tolist() == expected_drafts([5, 6, 7, 5, 6], 7)


def test_k_zero_ships_context_only(server, client_factory):
    client = client_factory(server.address)
    out = client.step(rows(["a"], [(0, [1, 2, 3])], k=0))
    assert out.drafts.shape == (1, 0) and out.deferred
    client.flush()
    stats = client.server_stats()
    assert stats.get("ops", {}).get("propose", 0) == 0 and stats["ingested_rows"] == 3


def test_while_waiting_runs_once_a_propose_is_out_before_its_reply(server, client_factory):
    """A step's ``while_waiting`` (the controller choosing off the drafts' critical path) runs once per
    propose, after the message left and before its reply is read; a step with nothing to propose
    never calls it. The drafts are what the server sent."""
    client = client_factory(server.address)
    seen = []

    def during():
        seen.append((client.link.conn.in_flight, client.stats()["counters"].get("sync_proposals", 0)))
    history = [5, 6, 7, 5, 6]
    out = client.step(rows(["a"], [(0, history)], anchors=[7]), during)
    assert seen == [(1, 1)]                          # the propose was in flight, its reply not yet read
    assert out.drafts.tolist() == [expected_drafts(history, 7)] and client.link.conn.in_flight == 0
    client.step(rows(["a"], [(5, [7])], sampled=[False]), during)   # an ingest: nobody to wait for
    client.step(rows(["a"], [(6, [8])], k=0), during)
    client.flush()
    assert len(seen) == 1


def test_no_deferral_waits_for_ingest(server, client_factory):
    client = client_factory(server.address, ring_depth=0)
    out = client.step(rows(["a"], [(0, [1, 2, 3])], sampled=[False]))
    assert not out.deferred and client.link.conn.in_flight == 0
    assert client.stats()["counters"]["sync_ingests"] == 1


def test_per_request_error_disables_only_that_request(small_server, client_factory):
    client = client_factory(small_server.address, max_rows=BIG + 16)
    big = [3, 4] * (BIG // 2)
    out = client.step(rows(["a", "b"], [(0, [1, 2, 1, 2]), (0, big)], anchors=[1, 3]))
    assert out.drafts[0].tolist() == expected_drafts([1, 2, 1, 2], 1)
    assert out.drafts[1].tolist() == [-1] * K                       # CAPACITY: b only
    assert client.is_disabled("b") and not client.is_disabled("a")
    out = client.step(rows(["a", "b"], [(4, [1]), (BIG, [3])], anchors=[2, 4]))
    assert out.drafts[0].tolist() == expected_drafts([1, 2, 1, 2, 1], 2)
    assert out.drafts[1].tolist() == [-1] * K                       # still disabled, and not sent
    client.finish(["b"])
    assert not client.is_disabled("b")
    out = client.step(rows(["b"], [(0, [3, 4, 3, 4])], anchors=[3]))   # back as a new request
    assert out.drafts[0].tolist() == expected_drafts([3, 4, 3, 4], 3)
    counters = client.stats()["counters"]
    assert counters["failures.request"] == 1 and counters["disabled_requests"] == 1
    assert client.server_stats()["errors"] == {"CAPACITY": 1}


def test_a_failure_disables_the_request_it_names_in_mixed_steps(small_server, client_factory):
    """A step of proposing and ingest-only requests goes out as an ingest and a propose message;
    a failure's index is the one of its own message: the client disables the request it names,
    whichever message it was in, and no request of the other message."""
    client = client_factory(small_server.address, max_rows=2 * BIG + 64)
    big = [3, 4] * (BIG // 2)
    hist = {"p0": [1, 2, 1, 2], "i0": [5, 6, 5], "i1": [7, 8, 7], "p1": [3, 4, 3]}
    names = ["i0", "p0", "big", "i1", "p1"]
    chunks = [(0, hist["i0"]), (0, hist["p0"]), (0, big), (0, hist["i1"]), (0, hist["p1"])]
    out = client.step(rows(names, chunks, sampled=[False, True, True, False, True], anchors=[6, 1, 3, 8, 4]))
    assert out.drafts.tolist() == [[-1] * K, expected_drafts(hist["p0"], 1), [-1] * K, [-1] * K,
                                   expected_drafts(hist["p1"], 4)]
    client.flush()
    assert [n for n in names if client.is_disabled(n)] == ["big"]          # the propose's index 1
    names2 = ["p0", "i0", "i1", "late", "p1"]                              # "late": ingest-only, too big
    chunks = [(4, [1]), (3, [6]), (3, [8]), (0, big), (3, [4])]
    out = client.step(rows(names2, chunks, sampled=[True, True, True, False, True], anchors=[2, 5, 7, 3, 3]))
    assert out.drafts.tolist() == [expected_drafts(hist["p0"] + [1], 2), expected_drafts(hist["i0"] + [6], 5),
                                   expected_drafts(hist["i1"] + [8], 7), [-1] * K,
                                   expected_drafts(hist["p1"] + [4], 3)]
    client.flush()
    assert [n for n in names + names2 if client.is_disabled(n)] == ["big", "late"]   # the ingest's index 3
    assert client.server_stats()["errors"] == {"CAPACITY": 2}


def test_deferred_ingest_failure_is_drained_by_next_step(small_server, client_factory):
    client = client_factory(small_server.address, max_rows=BIG + 16)
    big = [4, 5, 6] * (BIG // 3 + 1)
    out = client.step(rows(["good", "bad"], [(0, [1, 2, 3]), (0, big)], sampled=[False, False]))
    assert out.deferred and not client.is_disabled("bad")          # no reply read yet
    out = client.step(rows(["good", "bad"], [(3, [1]), (len(big), [4])], anchors=[2, 5]))
    assert client.is_disabled("bad") and not client.is_disabled("good")
    assert out.drafts[1].tolist() == [-1] * K
    assert out.drafts[0].tolist() == expected_drafts([1, 2, 3, 1], 2)


def test_finish_frees_and_retains(server, client_factory):
    client = client_factory(server.address)
    client.step(rows(["a", "b"], [(0, [1, 2, 3]), (0, [4, 5])], anchors=[1, 4]))
    client.finish(["a", "b", "never-seen"])
    client.flush()
    stats = client.server_stats()
    assert stats["active"] == 0 and stats["retained"] == 2 and stats["errors"] == {}


def test_a_free_never_overtakes_the_deferred_ingest_of_its_request(server, client_factory, monkeypatch):
    """A request leaves right after a step whose rows are still being copied for a deferred ingest
    (an abort mid-prefill, an off step): its free reaches the server after those rows. (Sent ahead
    of them, the late rows brought the freed request back to life on the server: active for good,
    holding one of the session's request slots.)"""
    from helpers.steps import held_copies
    client = client_factory(server.address, ring_depth=2)
    client.step(rows(["a"], [(0, [1, 2, 3])], anchors=[4]))
    copied = held_copies(monkeypatch)                 # the deferred rows' copy is still running
    assert client.step(rows(["a"], [(3, [4, 5, 6])], sampled=[False])).deferred
    monkeypatch.undo()
    client.finish(["a"])
    copied.set()
    client.flush()
    stats = client.server_stats()
    assert stats["active"] == 0 and stats["retained"] == 1 and stats["errors"] == {}


def test_close_frees_everything_it_owns(server, client_factory):
    keeper = client_factory(server.address)
    keeper.step(rows(["k"], [(0, [1, 2, 3])], anchors=[1]))
    client = client_factory(server.address)
    client.step(rows(["a", "b"], [(0, [1, 2, 3]), (0, [4, 5])], anchors=[1, 4]))
    assert keeper.server_stats()["active"] == 3
    client.finish(["b"])
    client.flush()
    stats = keeper.server_stats()
    assert stats["active"] == 2 and stats["retained"] == 1
    client.close()
    stats = keeper.server_stats()
    assert stats["active"] == 1 and stats["retained"] == 0 and len(stats["sessions"]) == 1


def test_prefix_cache_hit_reconnects_to_retained_request(server, client_factory):
    client = client_factory(server.address)
    prompt = list(range(100, 140))                      # 40 tokens
    client.step(rows(["a"], [(0, prompt)], anchors=[100]))
    client.finish(["a"])
    new_prompt = prompt[:32] + [100, 101, 102, 103]
    # the target's prefix cache covered 32 tokens: rows start at position 32
    out = client.step(rows(["b"], [(32, new_prompt[32:])], anchors=[104], prompts={"b": new_prompt}))
    assert out.drafts[0].tolist() == expected_drafts(new_prompt, 104)
    client.flush()
    stats = client.server_stats()
    assert stats["ops"]["reconnect"] == 1 and stats["errors"] == {}
    assert client.stats()["counters"]["reconnects"] == 1


def test_preempted_request_resumes_drafting(server, client_factory):
    """Freed with retain at preemption, back under the same id at a prefix-cache hit."""
    client = client_factory(server.address)
    history = [5, 6, 7, 8] * 8
    client.step(rows(["r"], [(0, history)], anchors=[5]))
    client.finish(["r"])                                  # preempted: dropped from the batch
    out = client.step(rows(["r"], [(32, [5])], anchors=[6], prompts={"r": history + [5]}))
    assert out.drafts[0].tolist() == expected_drafts(history + [5], 6)
    assert not client.is_disabled("r")


def test_prefix_hit_without_match_rebuilds_from_tokens(server, client_factory):
    client = client_factory(server.address)
    prompt = [9, 8, 7, 6] * 8 + [1, 2]
    out = client.step(rows(["c"], [(32, prompt[32:])], anchors=[9], prompts={"c": prompt}))
    assert out.drafts[0].tolist() == expected_drafts(prompt, 9)
    assert client.stats()["counters"]["reconnects"] == 1
    assert client.server_stats()["errors"] == {}


def test_prefix_hit_without_prompt_is_disabled(server, client_factory):
    client = client_factory(server.address)
    out = client.step(rows(["d", "e"], [(16, [1, 2]), (0, [1, 2, 1])], anchors=[3, 2]))
    assert out.drafts[0].tolist() == [-1] * K
    assert out.drafts[1].tolist() == expected_drafts([1, 2, 1], 2)
    assert client.is_disabled("d") and client.stats()["counters"]["failures.cold_start"] == 1


def test_client_gap_disables_request(server, client_factory):
    client = client_factory(server.address)
    client.step(rows(["a"], [(0, [1, 2, 3])], anchors=[4]))
    out = client.step(rows(["a"], [(10, [5])], anchors=[6]))
    assert out.drafts[0].tolist() == [-1] * K and client.is_disabled("a")


def test_rewind_restarts_context(server, client_factory):
    client = client_factory(server.address)
    client.step(rows(["a"], [(0, [1, 2, 3, 4])], anchors=[5]))
    out = client.step(rows(["a"], [(0, [6, 7, 6])], anchors=[7]))   # preempted and recomputed
    assert out.drafts[0].tolist() == expected_drafts([6, 7, 6], 7)


def test_oversized_step_is_split(client_factory):
    """Context far beyond ``--max-message-mb 1`` still drafts correctly, in several messages."""
    srv = ServerProcess("--engine", "ngram", "--max-message-mb", "1")
    try:
        client = client_factory(srv.address, max_rows=400_000, timeout_ms=60_000)
        history = [1, 2, 3, 4, 5, 6, 7] * 40_000 + [1, 2]               # 280,002 rows: ~2.1 MiB
        out = client.step(rows(["a", "b"], [(0, history), (0, [9, 8, 9])], anchors=[3, 8]))
        assert out.drafts.tolist() == [expected_drafts(history, 3), expected_drafts([9, 8, 9], 8)]
        assert client.stats()["counters"]["split_messages"] >= 3
        stats = client.server_stats()
        assert stats["errors"] == {} and stats["ingested_rows"] == len(history) + 3
    finally:
        srv.stop()


def test_incompatible_k_fails_closed(server, client_factory, caplog):
    client = client_factory(server.address, num_speculative_tokens=64)
    assert client.state.value == "incompatible"
    assert "does not fit" in caplog.text and "K: target asks for 64, server allows 16" in caplog.text
    out = client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2], k=4))
    assert out.drafts.tolist() == [[-1] * 4]
    # the server opened a session at hello; the client that will not use it says goodbye at once
    observer = client_factory(server.address)
    assert list(observer.server_stats()["sessions"]) == [observer.server_stats()["session"]]


def test_logits_required_but_unsupported_fails_closed(server, client_factory):
    client = client_factory(server.address, logits="full")
    assert client.state.value == "incompatible"


def test_bad_step_input_raises_typed_error(server, client_factory):
    client = client_factory(server.address)
    inp = rows(["a"], [(0, [1, 2])])
    inp.counts = [3]
    with pytest.raises(StepInputError):
        client.step(inp)
    with pytest.raises(StepInputError):
        client.step(rows(["a", "a"], [(0, [1]), (0, [2])]))
    with pytest.raises(StepInputError):
        client.step(rows(["a"], [(0, [1, 2])], k=17))


def test_server_unreachable_at_start_then_appears(client_factory):
    srv = ServerProcess("--engine", "ngram", ready=False)
    srv.kill()                                            # the port is known, nobody listens
    client = client_factory(srv.address, timeout_ms=1000)
    assert client.state.value == "disconnected"
    out = client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    assert out.drafts.tolist() == [[-1] * K]
    srv.start()
    try:
        assert drafts_again(client)
    finally:
        srv.stop()


def test_flush_with_a_reply_that_never_comes_fails_closed_and_does_not_raise(server, client_factory):
    """flush (shutdown, tests) while a propose's reply is overdue: the link is dropped and the
    request fails closed as in a step; nothing raises into the caller, and drafting comes back."""
    client = client_factory(server.address, timeout_ms=1000, propose_timeout_ms=50)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    client.flush()
    server.pause()
    try:
        out = client.step(rows(["a"], [(3, [2])], anchors=[1]))       # late: the step goes on without drafts
        assert out.drafts.tolist() == [[-1] * K]
        client.flush()                                                # the reply is overdue: no raise
    finally:
        server.resume()
    assert client.is_disabled("a") and client.stats()["counters"]["failures.transport"] >= 1
    assert client.link.conn.in_flight == 0
    assert drafts_again(client)


def test_timeout_disables_batch_and_recovers(server, client_factory):
    client = client_factory(server.address, timeout_ms=2000)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    server.pause()
    try:
        out = client.step(rows(["a"], [(3, [2])], anchors=[1]))      # (the bound: test_transport_faults)
    finally:
        server.resume()
    assert out.drafts.tolist() == [[-1] * K]
    assert client.is_disabled("a")
    assert client.stats()["counters"]["failures.transport"] >= 1
    assert drafts_again(client)
    assert client.stats()["counters"].get("server_restarts", 0) == 0
    # the link is back: "a" (disabled only by the link) drafts again once its history comes along
    assert not client.is_disabled("a") and "a" in client.wants_history()   # (and drafts_again's that were too early)
    out = client.step(rows(["a"], [(4, [1])], anchors=[2], prompts={"a": [1, 2, 1, 2]}))
    found = lookup([1, 2, 1, 2, 1, 2], K)
    assert out.drafts.tolist() == [found + [-1] * (K - len(found))] and found
    assert "a" not in client.wants_history() and client.stats()["counters"]["rearmed_requests"] >= 1


def test_server_restart_disables_everything_and_new_requests_draft(client_factory):
    srv = ServerProcess("--engine", "ngram")
    try:
        client = client_factory(srv.address, timeout_ms=2000)
        client.step(rows(["a", "b"], [(0, [1, 2, 1]), (0, [3, 4, 3])], anchors=[2, 4]))
        old_id = client.stats()["server_id"]
        srv.restart()
        assert drafts_again(client)
        client.step(rows(["c"], [(0, [1, 2, 1])], anchors=[2]))
        out = client.step(rows(["a", "b", "c"], [(3, [2]), (3, [4]), (3, [2])], anchors=[1, 3, 1]))
        assert out.drafts[0].tolist() == [-1] * K and out.drafts[1].tolist() == [-1] * K
        assert out.drafts[2].tolist() == expected_drafts([1, 2, 1, 2], 1)
        stats = client.stats()
        assert stats["server_id"] != old_id and stats["counters"]["server_restarts"] >= 1
    finally:
        srv.stop()


def test_stats_snapshot_shape(server, client_factory):
    client = client_factory(server.address, timing_log_interval=1)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    snap = client.stats()
    assert snap["state"] == "ready" and snap["ring"]["pinned"] == torch.cuda.is_available()
    assert {"stage", "enqueue", "wait", "round_trip", "step"} <= set(snap["phases"])
    assert snap["requests"]["tracked"] == 1


def test_accepted_drafts_are_counted(server, client_factory):
    client = client_factory(server.address)
    inp = rows(["a"], [(0, [1, 2, 1])], anchors=[2])
    inp.num_accepted = [3]
    client.step(inp)
    assert client.stats()["counters"]["accepted_drafts"] == 3


def test_empty_step(server, client_factory):
    client = client_factory(server.address)
    out = client.step(StepInput([], [], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                                [], [], [], k=K))
    assert out.drafts.shape == (0, K)


def test_out_of_vocab_drafts_are_dropped(server, client_factory, caplog):
    """A server whose drafts hold ids >= the target's vocabulary (here: an ngram engine fed
    ids the target would never produce): those requests get no draft, the rest draft."""
    client = client_factory(server.address, target_vocab_size=100)
    histories = {"ok": [1, 2, 3, 1, 2], "vocab": [5, 6, 100, 5], "huge": [7, 8, 10 ** 9, 7]}
    anchors = {"ok": 3, "vocab": 6, "huge": 8}
    ids = list(histories)
    out = client.step(rows(ids, [(0, histories[i]) for i in ids], anchors=[anchors[i] for i in ids]))
    assert out.drafts[0].tolist() == expected_drafts(histories["ok"], 3)
    assert lookup([*histories["vocab"], 6], K)[0] == 100          # the server did draft them ...
    assert lookup([*histories["huge"], 8], K)[0] == 10 ** 9
    assert out.drafts[1:].tolist() == [[-1] * K, [-1] * K]        # ... the client dropped them
    assert client.stats()["counters"]["out_of_vocab_drafts"] == 2
    assert caplog.text.count("outside the target's vocabulary") == 1
    assert not client.is_disabled("vocab")                        # only this step's drafts
    out = client.step(rows(ids, [(5, [3]), (4, [6]), (4, [8])], anchors=[1, 9, 9]))
    assert out.drafts[0].tolist() == expected_drafts(histories["ok"] + [3], 1)
    assert caplog.text.count("outside the target's vocabulary") == 1     # logged once


def test_requests_beyond_the_servers_limit_are_not_drafted_and_not_errors(client_factory):
    """More running requests than the server admits per client: the excess is counted and
    simply not drafted; no error storm, and a slot freed by a finished request is reused."""
    srv = ServerProcess("--engine", "ngram", "--max-requests", "2")
    try:
        client = client_factory(srv.address)
        assert client.caps.max_requests == 2
        ids = ["a", "b", "c", "d"]
        out = client.step(rows(ids, [(0, [1, 2, 1])] * 4, anchors=[2] * 4))
        assert out.drafts[:2].tolist() == [expected_drafts([1, 2, 1], 2)] * 2
        assert out.drafts[2:].tolist() == [[-1] * K] * 2
        out = client.step(rows(ids, [(3, [2])] * 4, anchors=[1] * 4))
        assert out.drafts[2:].tolist() == [[-1] * K] * 2
        counters = client.stats()["counters"]
        assert counters["over_capacity"] == 2 and not any(k.startswith("failures.") for k in counters)
        client.finish(["a"])
        out = client.step(rows(["e"], [(0, [4, 5, 4])], anchors=[5]))     # a's slot is free again
        assert out.drafts[0].tolist() == expected_drafts([4, 5, 4], 5)
        client.flush()
        assert client.server_stats()["errors"] == {}
    finally:
        srv.stop()


def test_rows_of_a_step_nobody_drafts_in_wait_for_a_busy_slot_and_are_never_lost(server, client_factory):
    """Context is never dropped: a step without drafts (the controller stepped aside) whose staging
    slot is still held by the server waits for it, its rows reach the server, and its requests
    draft later (rows dropped once meant the request could never draft again: the GPU run's
    off-steps found the slot held by an ingest whose reply was not read yet, every time)."""
    client = client_factory(server.address, ring_depth=1)
    assert client.step(rows(["a"], [(0, [1, 2, 3])], sampled=[False])).deferred
    server.pause()                                            # the slot stays held: no reply yet
    timer = threading.Timer(0.3, server.resume)
    try:
        client.sender.wait_idle(10)
        assert client.ring.next_busy()
        timer.start()
        client.step(rows(["b"], [(0, [4, 5, 6])], sampled=[False]))
    finally:
        timer.join()
        server.resume()
    assert not client.is_disabled("a") and not client.is_disabled("b")
    assert not any(k.startswith("failures.") for k in client.stats()["counters"])
    out = client.step(rows(["b"], [(3, [4])], anchors=[4]))
    assert out.drafts[0].tolist() == expected_drafts([4, 5, 6, 4], 4)
    client.flush()
    assert client.server_stats()["ingested_rows"] == 7 and client.server_stats()["errors"] == {}


def test_only_requests_the_link_disabled_draft_again(server, client_factory):
    """Once the link is back, a request disabled by the link (a timeout) drafts again; one disabled
    for its own trouble (rows that skip past its context) stays off until it leaves the batch."""
    client = client_factory(server.address, timeout_ms=1500)
    client.step(rows(["ok", "bad"], [(0, [1, 2, 1]), (0, [3, 4, 3])], anchors=[2, 4]))
    client.step(rows(["bad"], [(9, [5])], anchors=[6]))                  # a gap: its own failure
    assert client.is_disabled("bad") and not client.is_disabled("ok")
    server.pause()
    try:
        client.step(rows(["ok"], [(3, [2])], anchors=[1]))               # times out: the link's failure
    finally:
        server.resume()
    assert client.is_disabled("ok")
    assert drafts_again(client)
    assert not client.is_disabled("ok") and "ok" in client.wants_history()
    assert client.is_disabled("bad") and "bad" not in client.wants_history()


def test_an_anchor_before_its_own_rows_costs_that_request_only(server, client_factory):
    """``anchor_positions[i] - counts[i]`` is where request i's rows start; an adapter that hands
    an anchor position before its own rows (a negative start) describes no context at all. That
    request sits the step out, disabled, and is named; the others of the same message draft as
    usual (the server would refuse the whole message, failing every request in it)."""
    client = client_factory(server.address)
    inp = rows(["good", "bad"], [(0, [1, 2, 1]), (0, [3, 4, 3])], anchors=[2, 4])
    inp.anchor_positions = [3, 1]                     # "bad": 3 rows ending before position 1
    out = client.step(inp)
    assert out.drafts[0].tolist() == expected_drafts([1, 2, 1], 2)
    assert out.drafts[1].tolist() == [-1] * K
    assert client.is_disabled("bad") and not client.is_disabled("good")
    out = client.step(rows(["good"], [(3, [2])], anchors=[1]))
    assert out.drafts[0].tolist() == expected_drafts([1, 2, 1, 2], 1)
