"""The client under faults: bounded waits, frees that survive an outage, nothing stale kept.

Bounds are asserted as "no later than the bound plus a generous margin" (a
correct client can be slow on a loaded machine, but never seconds late), and
every wait for a condition polls with a deadline.
"""
from __future__ import annotations

import threading
import time

import pytest

from helpers.steps import drafts_again, step as rows, wait_until

MARGIN_S = 3.5          # scheduling slack on a busy 2-core box; a 5 s late timeout still fails


def test_a_silent_server_costs_a_step_no_more_than_the_timeout(server, client_factory):
    client = client_factory(server.address, timeout_ms=1000)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    server.pause()
    try:
        started = time.monotonic()
        out = client.step(rows(["a"], [(3, [2])], anchors=[1]))
        waited = time.monotonic() - started
    finally:
        server.resume()
    assert out.drafts.tolist() == [[-1] * 4] and client.is_disabled("a")
    assert 1.0 <= waited <= 1.0 + MARGIN_S, waited


def test_close_with_work_in_flight_is_bounded_and_leaks_no_slot(server, client_factory):
    client = client_factory(server.address, timeout_ms=1000, ring_depth=2)
    client.step(rows(["a"], [(0, list(range(64)))], sampled=[False]))       # deferred
    server.pause()
    try:
        client.step(rows(["a"], [(64, list(range(64)))], sampled=[False]))  # in flight, unanswered
        started = time.monotonic()
        client.close()
        assert time.monotonic() - started <= 1.0 + 2.0 + MARGIN_S          # bye waits 2 s at most
    finally:
        server.resume()
    assert all(slot.holds == 0 for slot in client.ring.slots)


def test_frees_queued_during_an_outage_reach_the_server_afterwards(server, client_factory):
    """70 requests finish while the server is unreachable; once it answers again none of
    them stays active on it (the client keeps every unsent free, no cap)."""
    client = client_factory(server.address, timeout_ms=1000)
    ids = [f"r{i}" for i in range(70)]
    client.step(rows(ids, [(0, [i, i + 1, i]) for i in range(70)], anchors=[i + 1 for i in range(70)]))
    client.flush()
    assert client.server_stats()["active"] == 70
    server.pause()
    try:
        client.step(rows(["probe"], [(0, [1, 2])], anchors=[1]))             # times out: link lost
        assert client.state.value == "disconnected"
        for rid in ids:                                   # one by one, as requests end: nowhere to send them
            client.finish([rid])
    finally:
        server.resume()
    assert drafts_again(client)
    client.flush()
    assert wait_until(lambda: client.server_stats()["active"] <= 1 + 1)     # the probe and the last n
    stats = client.server_stats()
    assert stats["retained"] <= 70 + 1 and client.book.stats()["unsent_frees"] == 0     # freed: retained, not active


def test_a_request_the_link_rearmed_is_freed_when_it_leaves(server, client_factory):
    """A request disabled by a lost link drafts again once it is back (its history comes with its
    next rows); if it leaves the batch before that, the server (the same one: it kept this client's
    session) still holds it and is told to free it, instead of keeping it active for good."""
    client = client_factory(server.address, timeout_ms=1500)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    server.pause()
    try:
        client.step(rows(["a"], [(3, [2])], anchors=[1]))                  # times out: the link's failure
    finally:
        server.resume()
    assert drafts_again(client) and "a" in client.wants_history()
    client.finish(["a"])                                                    # gone before its history went out
    client.finish([rid for rid in list(client.book.records)])               # drafts_again's own requests
    client.flush()
    assert client.stats()["counters"].get("server_restarts", 0) == 0
    assert wait_until(lambda: client.server_stats()["active"] == 0, timeout=10)


def test_a_new_request_whose_rows_came_while_the_hello_was_in_flight_drafts_once_the_link_is_up(
        server, client_factory):
    """A request first seen in a step while the client's hello is unanswered (the server reclaimed
    its session, or it just reconnected): its rows could not be sent, so once the link is up it asks
    for the request's history and the request drafts, instead of sitting out its whole life as a
    prefix-cache hit with no prompt (the target sends a prompt only with a request's first step)."""
    client = client_factory(server.address, timeout_ms=20000)
    server.pause()
    try:
        client.link.rehello("planted: the server reclaimed the session")     # a hello nobody answers yet
        out = client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2], prompts={"a": [1, 2, 1]}))
        assert out.drafts.tolist() == [[-1] * 4] and client.state.value == "connecting"
    finally:
        server.resume()
    history, drafted = [1, 2, 1, 2], False
    for _ in range(200):
        prompts = {"a": history[:-1]} if "a" in client.wants_history() else None
        out = client.step(rows(["a"], [(len(history) - 1, history[-1:])], anchors=[history[-2]],
                               prompts=prompts))
        if out.drafts[0, 0] >= 0:
            drafted = True
            break
        history.append(history[-2])
        time.sleep(0.02)
    assert drafted, client.book.get("a")


def test_a_disabled_request_is_kept_as_a_reconnect_source(server, client_factory):
    """What the server holds of a request disabled by a gap is a correct prefix: it is kept (a
    request that never reached the server has nothing to keep)."""
    client = client_factory(server.address)
    client.step(rows(["bad", "good"], [(0, [5, 6, 7, 5]), (0, [1, 2, 1])], anchors=[6, 2]))
    client.step(rows(["bad"], [(9, [8])], anchors=[9]))                     # a gap: disabled
    client.step(rows(["cold"], [(16, [1, 2])], anchors=[3]))                # never on the server
    assert client.is_disabled("bad") and client.is_disabled("cold")
    client.finish(["bad", "good", "cold"])
    client.flush()
    stats = client.server_stats()
    assert stats["active"] == 0 and stats["retained"] == 2                  # "bad" and "good"


def test_the_sender_thread_failing_fails_closed_like_a_socket(server, client_factory, monkeypatch):
    client = client_factory(server.address, ring_depth=2)
    boom = RuntimeError("planted sender failure")

    def post(*args, **kwargs):
        if threading.current_thread().name == "k3-draft-sender":
            raise boom
        return original(*args, **kwargs)
    original = client.link.conn.post
    monkeypatch.setattr(client.link.conn, "post", post)
    assert client.step(rows(["a"], [(0, [1, 2, 3])], sampled=[False])).deferred
    client.sender.wait_idle(10)
    out = client.step(rows(["a", "b"], [(3, [1]), (0, [1, 2, 1])], anchors=[2, 2]))
    assert out.drafts.tolist() == [[-1] * 4, [-1] * 4]                      # the batch failed closed
    assert client.is_disabled("a")
    counters = client.stats()["counters"]
    assert counters["failures.sender"] == 1 and counters["failures.transport"] >= 1
    monkeypatch.undo()
    assert drafts_again(client)                                             # and it recovers


def test_a_deferred_copy_that_fails_frees_its_slot(server, client_factory, monkeypatch):
    """The device->pinned copy of a deferred chunk fails on the sender thread (a CUDA error there;
    planted, as this machine may have no CUDA): its requests fail closed, nothing is sent from
    the slot, and the slot is free again (fresh memory) instead of blocking the ring for good."""
    from k3_accel.transport import layout
    client = client_factory(server.address, ring_depth=1, timeout_ms=2000)

    class FailingCopy:
        def synchronize(self):
            raise RuntimeError("planted copy failure")
    stage = layout.stage
    monkeypatch.setattr(layout, "stage", lambda *a, **kw: (stage(*a, **kw), FailingCopy())[1])
    assert client.step(rows(["a"], [(0, [1, 2, 3])], sampled=[False])).deferred
    client.sender.wait_idle(10)
    monkeypatch.undo()
    slot = client.ring.slots[0]
    assert slot.holds == 0 and slot.retired
    assert drafts_again(client)                                             # through that same slot
    counters = client.stats()["counters"]
    assert counters["failures.sender"] == 1
    assert not client.is_disabled("a") and "a" in client.wants_history()   # the link is back: drafting again
    assert "failures.ring_timeout" not in counters and slot.generation == 1


@pytest.mark.parametrize("heartbeat_ms", [200])
def test_an_idle_client_keeps_its_session_alive_with_heartbeats(client_factory, heartbeat_ms):
    from helpers.server import ServerProcess
    srv = ServerProcess("--engine", "ngram", "--lease-s", "1.5")
    try:
        client = client_factory(srv.address, heartbeat_ms=heartbeat_ms)
        client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
        deadline = time.monotonic() + 4.0                                   # > 2 leases, idle
        while time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.server_stats()
        assert stats["sessions_reclaimed"] == 0 and stats["active"] == 1
        assert client.stats()["counters"]["heartbeats"] >= 1
    finally:
        srv.stop()


def test_an_idle_client_heartbeats_within_the_lease_the_server_advertises(client_factory):
    """The default heartbeat (2 s) against a server whose lease is half of it (1 s): the client
    beats within the advertised lease, so idling for several leases loses nothing. (Beating every
    2 s, it would lose its session within the first 2 s of idling: the server reclaims a session
    after a lease without a message, checking every 0.5 s.)"""
    from helpers.server import ServerProcess
    srv = ServerProcess("--engine", "ngram", "--lease-s", "1")
    try:
        client = client_factory(srv.address)
        assert client.settings.heartbeat_ms == 2000 and client.caps.lease_s == 1
        client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
        deadline = time.monotonic() + 6.0                                   # 6 leases, idle
        while time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.server_stats()
        assert stats["sessions_reclaimed"] == 0 and stats["active"] == 1
        out = client.step(rows(["a"], [(3, [2])], anchors=[1]))              # its context is still there
        assert out.drafts[0, :2].tolist() == [2, 1] and not client.is_disabled("a")
    finally:
        srv.stop()


def test_a_sender_failure_on_a_lost_socket_does_not_drop_the_next_link(server, client_factory):
    """The sender thread failed on a socket the step thread then dropped (a flush that timed out):
    the reconnected link is not dropped again for that old failure."""
    client = client_factory(server.address)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    client.sender.broken = RuntimeError("planted: a post on the old socket failed")
    client.link.lose(RuntimeError("planted: no reply within the timeout"))
    assert drafts_again(client)
    assert client.stats()["counters"]["transport_errors"] == 1             # only the planted loss


@pytest.mark.timeout(120)                 # the old client waited out the ten minutes here
def test_a_message_the_restarted_server_never_got_does_not_hold_its_slot_until_its_timeout(client_factory):
    """A deferred ingest sits unread in a paused server when the server is killed and started
    again: the new server never gets it. The server answers a connection's messages in order, so
    once a later message of this socket is answered the earlier one is known lost; the client
    must fail it closed then (its staging slot free again, its request drafting again with its
    history) instead of holding the slot for the whole timeout (ten minutes here)."""
    from helpers.server import ServerProcess
    srv = ServerProcess("--engine", "ngram")
    try:
        client = client_factory(srv.address, timeout_ms=600_000, ring_depth=2)
        client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
        srv.pause()
        client.step(rows(["a"], [(3, list(range(8)))], sampled=[False]))     # deferred, never read
        assert client.sender.wait_idle(60)                                    # it left the client
        srv.restart()
        assert wait_until(lambda: client.link.conn.writable(0))   # reconnected before the next send: the
        assert drafts_again(client)                   # loss shows only as a propose answered by the new server ...
        assert client.link.conn.in_flight == 0        # ... and nothing older still waits for a reply
        assert all(slot.holds == 0 for slot in client.ring.slots)
    finally:
        srv.stop()


def test_a_rearmed_request_that_starts_over_from_its_first_row_stops_asking_for_its_history(server, client_factory):
    """After the link came back a request drafts again "with its history": its next rows bring the
    tokens before them. A request whose next rows start at 0 (vLLM recomputes it from scratch, e.g.
    after a preemption) brings its whole context in those rows: from then on it needs no history, and
    asking for it every step would make the adapter gather the whole token list at every step."""
    client = client_factory(server.address, timeout_ms=1000)
    client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
    server.pause()
    try:
        client.step(rows(["a"], [(3, [2])], anchors=[1]))            # times out: the link is lost
    finally:
        server.resume()
    assert drafts_again(client)
    assert "a" in client.wants_history()
    out = client.step(rows(["a"], [(0, [1, 2, 1, 2])], anchors=[1]))  # recomputed from its first row
    assert out.drafts[0, :2].tolist() == [2, 1]
    assert "a" not in client.wants_history()


def test_a_free_lost_with_the_link_reaches_the_server_afterwards(client_factory, tmp_path_factory):
    """A free queued behind rows a stalled server never read (more bytes than the socket's buffers
    hold) is dropped with the socket when the link times out; the server, which keeps this client's
    session over the reconnect, held the request active for good (a request slot and its blocks
    gone for the target's life). A free lost with the link is sent again once it is back (freeing
    is idempotent: a free the server did get changes nothing the second time)."""
    from helpers.server import ServerProcess
    path = tmp_path_factory.mktemp("ipc", numbered=True) / "s.sock"      # a unix socket: small buffers
    rows_per_step = 1 << 17                                              # 1 MiB of token ids a step
    srv = ServerProcess("--engine", "ngram", "--ipc-path", str(path))
    try:
        client = client_factory(f"ipc://{path}", timeout_ms=1500, max_rows=rows_per_step, ring_depth=2)
        client.step(rows(["a"], [(0, [1, 2, 1])], anchors=[2]))
        client.flush()
        assert client.server_stats()["active"] == 1
        srv.pause()
        try:
            for i in range(2):                                           # deferred, never read
                client.step(rows([f"big{i}"], [(0, [7] * rows_per_step)], sampled=[False]))
            assert client.sender.wait_idle(60)
            client.finish(["a"])                                         # its free queues behind them
            client.step(rows(["b"], [(0, [3, 4, 3])], anchors=[4]))      # times out: the link is dropped
            assert client.state.value == "disconnected"
        finally:
            srv.resume()
        assert drafts_again(client)
        client.finish(list(client.book.records))
        client.flush()
        assert wait_until(lambda: client.server_stats()["active"] == 0, timeout=30), client.server_stats()
    finally:
        srv.stop()
