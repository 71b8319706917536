"""Namespaces and leases (issue 10): clients of one server never see each other's state."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.oracles import ngram_lookup
from helpers.server import ServerProcess, src_env
from helpers.steps import wait_until
from helpers.wire import Wire, ints
from k3_accel import protocol as p

K = 4
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "ngram", "--block-size", "4", "--lease-s", "0")
    yield s
    assert s.stop() == 0


def lookup(history) -> list[int]:
    found = ngram_lookup(history, K)
    return found + [-1] * (K - len(found))


def drafts(w: Wire, spans) -> list[list[int]]:
    return w.propose(K, spans).raise_for_error().tensors["drafts"].tolist()


def stats(w: Wire) -> dict:
    return w.call(p.Stats()).raise_for_error().result


def session_labels(server: ServerProcess) -> set[str]:
    """Every ``session`` label value on ``/metrics``."""
    return {s.labels["session"] for fam in text_string_to_metric_families(server.metrics())
            for s in fam.samples if "session" in s.labels}


def consistent(s: dict) -> bool:
    """Every active request the server counts belongs to a session it lists."""
    return s["active"] == sum(line["active"] for line in s["sessions"].values())


A = {0: [1, 2, 3, 1, 2], 1: [7, 8, 9, 7]}
B = {0: [4, 5, 4, 5, 4], 1: [9, 9, 1, 9]}


def _store(w: Wire, contexts: dict) -> None:
    w.ingest([(h, 0, toks) for h, toks in contexts.items()]).raise_for_error()


def _expected(contexts: dict, anchor: int) -> list[list[int]]:
    return [lookup(toks + [anchor]) for toks in contexts.values()]


def _ask(w: Wire, contexts: dict, anchor: int) -> list[list[int]]:
    return drafts(w, [(h, len(toks), [], anchor) for h, toks in contexts.items()])


def test_same_handles_in_two_sessions_draft_from_their_own_history(server):
    a, b = Wire(server.address), Wire(server.address)
    try:
        _store(a, A)
        _store(b, B)
        assert _expected(A, 1) != _expected(B, 1)
        assert _ask(a, A, 1) == _expected(A, 1) and _ask(b, B, 9) == _expected(B, 9)
        # b's reconnect only ever finds b's contexts (a holds [1, 2, 3, 1, 2])
        assert b.call(p.Reconnect(5, 4), ints([1, 2, 3, 1])).raise_for_error().result == {"restored": 0}
        assert a.call(p.Reconnect(5, 4), ints([1, 2, 3, 1])).raise_for_error().result == {"restored": 4}
        # a's rewind of its handle 0 leaves b's handle 0 alone
        assert drafts(a, [(0, 2, [], 1)]) == [lookup([1, 2, 1])]
        assert _ask(b, B, 4) == _expected(B, 4)
        for w in (a, b):                    # each keeps a retained context as well
            _store(w, {7: [6, 6, 6, 6]})
            w.call(p.Free([7])).raise_for_error()
        for msg in (p.Free([1, 7], retain=False), p.Clear(), p.Bye()):
            a.call(msg).raise_for_error()
            assert _ask(b, B, 5) == _expected(B, 5), msg
            assert stats(b)["sessions"][stats(b)["session"]]["retained"] == 1, msg
        assert b.call(p.Reconnect(8, 4), ints([6] * 4)).raise_for_error().result == {"restored": 4}
        assert consistent(stats(b))
        a.call(p.Hello(a.session)).raise_for_error()
        assert [f[1] for f in a.propose(K, [(1, 4, [], 7)]).failures] == ["CONTEXT_GAP"]
    finally:
        a.close()
        b.close()


def test_a_connection_presenting_the_session_key_reclaims_it(server):
    first = Wire(server.address)
    _store(first, A)
    name = stats(first)["session"]
    again = Wire(server.address, session=first.session)     # say, the client's socket was rebuilt
    try:
        assert stats(again)["session"] == name
        assert _ask(again, A, 3) == _expected(A, 3)
        assert stats(again)["sessions"][name]["active"] == len(A)
    finally:
        again.call(p.Bye())
        first.close()
        again.close()


def test_bye_ends_the_session_for_every_connection_bound_to_it(server):
    one = Wire(server.address)
    two = Wire(server.address, session=one.session)
    watcher = Wire(server.address)
    try:
        _store(one, A)
        assert one.call(p.Bye()).raise_for_error().result == {"released": len(A)}
        for w in (one, two):                # nothing can be stored in a session that ended
            reply = w.ingest([(0, 0, [1, 2, 3])])
            assert not reply.ok and reply.error[0] == "NO_SESSION"
        s = stats(watcher)
        assert consistent(s)
        assert one.call(p.Hello(one.session, "back")).ok     # a hello opens it again, empty
        assert [f[1] for f in one.propose(K, [(0, 5, [], 1)]).failures] == ["CONTEXT_GAP"]
    finally:
        for w in (one, two, watcher):
            w.close()


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers.wire import Wire, ints
w = Wire({address!r}, session={key!r})
w.ingest([(0, 0, [1, 2, 3, 1, 2]), (1, 0, [5, 5, 5])]).raise_for_error()
print(w.call(__import__("k3_accel.protocol").protocol.Stats()).result["session"], flush=True)
time.sleep(600)
"""


def test_lease_reclaims_a_killed_client_and_spares_one_that_keeps_talking():
    server = ServerProcess("--engine", "ngram", "--lease-s", "8")   # long beside the talker's 0.1 s pings
    key = "k" * 32
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=TESTS, address=server.address, key=key)],
                             stdout=subprocess.PIPE, text=True, env=src_env())
    talker = None
    try:
        name = child.stdout.readline().strip()
        assert name, "the client process did not start"
        talker = Wire(server.address)
        _store(talker, B)
        assert name in stats(talker)["sessions"]
        assert wait_until(lambda: name in session_labels(server))      # its series, while it lives
        child.kill()
        child.wait(60)
        deadline = time.monotonic() + 120
        while True:                         # the talker pings and asks, the lease runs out for the other
            assert talker.call(p.Ping()).ok
            s = stats(talker)
            if name not in s["sessions"]:
                break
            assert time.monotonic() < deadline, "the killed client's session was never reclaimed"
            time.sleep(0.1)
        assert s["sessions_reclaimed"] >= 1 and consistent(s)
        assert s["sessions"][s["session"]]["active"] == len(B)       # the talker kept everything
        assert _ask(talker, B, 4) == _expected(B, 4)
        assert 'k3_draft_sessions_reclaimed_total 1.0' in server.metrics()
        assert wait_until(lambda: name not in session_labels(server))  # the label is given back
        fresh = Wire(server.address, session=key)                    # the key now opens an empty namespace
        assert [f[1] for f in fresh.propose(K, [(0, 5, [], 3)]).failures] == ["CONTEXT_GAP"]
        _store(fresh, A)
        assert _ask(fresh, A, 3) == _expected(A, 3)
        fresh.close()
    finally:
        if child.poll() is None:
            child.kill()
        if talker is not None:
            talker.close()
        assert server.stop() == 0


@pytest.mark.parametrize("label", ["x" * 100_000, "vllm-dp0\nERROR forged log line"])
def test_a_hello_label_no_log_or_metric_can_hold_is_refused_and_reaches_no_other_client(server, label):
    """The hello label names the session in logs, /metrics and every client's stats: a huge one (or
    one that breaks log lines) is refused with BAD_FIELD, and the connection has no session."""
    w, other = Wire(server.address, hello=False), Wire(server.address)
    try:
        reply = w.call(p.Hello("h" * 16 + uuid.uuid4().hex, label))
        assert not reply.ok and reply.error[0] == "BAD_FIELD" and "hello.client" in reply.error[1]
        assert w.call(p.Ping()).error[0] == "NO_SESSION"
        assert not [name for name in stats(other)["sessions"] if label in name]
        assert not [name for name in session_labels(server) if label in name]
    finally:
        other.call(p.Bye())
        other.close()
        w.close()


def test_the_loop_lets_go_of_every_connection_whose_session_ended():
    """A connection's entry lives while it is bound to an open session; one whose session ended
    (bye, perhaps said on another connection) went only if it sent something more, so every
    short-lived client (a probe, a target that restarts) stayed in the loop's table, scanned at
    every turn, for the server's whole life."""
    import threading

    import zmq

    from helpers.service import LocalService
    from k3_accel.server.loop import ServerLoop

    local = LocalService()
    ctx = zmq.Context()
    loop = ServerLoop(local.service, ["tcp://127.0.0.1:0"], 1 << 26, ctx=ctx)
    stop = threading.Event()
    thread = threading.Thread(target=loop.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        assert loop.ready.wait(30)
        stay = Wire(loop.endpoints[0])
        for _ in range(20):
            w = Wire(loop.endpoints[0])
            w.ingest([(0, 0, [1, 2, 3])]).raise_for_error()
            assert w.call(p.Bye()).ok
            w.close()
        assert stay.call(p.Ping()).ok
        assert wait_until(lambda: len(loop._conns) == 1), f"{len(loop._conns)} connections kept"
        assert stay.call(p.Ping()).ok and list(local.store.sessions) == [stay.session]
        stay.close()
    finally:
        stop.set()
        thread.join(30)
        ctx.term()


def test_the_loop_lets_go_of_a_sessions_connections_that_went_silent_for_the_lease():
    """A target whose socket is rebuilt (a timeout, a server stopped for a while) says hello again with
    its session key on a new connection; the session lives on, and so did the old connection's entry,
    scanned at every turn, one more per reconnect for the target's whole life. A connection that sends
    nothing for the lease is forgotten like a session; one that speaks again gets NO_SESSION (and
    a hello binds it again), while the session and what it stores stay."""
    import threading

    import zmq

    from helpers.service import LocalService
    from k3_accel.server.loop import ServerLoop

    local = LocalService()
    ctx = zmq.Context()
    loop = ServerLoop(local.service, ["tcp://127.0.0.1:0"], 1 << 26, ctx=ctx, lease_s=1.0)
    stop = threading.Event()
    thread = threading.Thread(target=loop.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        assert loop.ready.wait(30)
        stay = Wire(loop.endpoints[0])
        _store(stay, A)
        idle = Wire(loop.endpoints[0], session=stay.session)
        for _ in range(20):                  # the same target reconnecting, again and again
            w = Wire(loop.endpoints[0], session=stay.session)
            assert w.call(p.Ping()).ok
            w.close()
        assert wait_until(lambda: stay.call(p.Ping()).ok and len(loop._conns) == 1, timeout=30), \
            f"{len(loop._conns)} connections kept"
        assert list(local.store.sessions) == [stay.session]
        assert idle.call(p.Ping()).error[0] == "NO_SESSION"              # forgotten: it says hello again
        assert idle.call(p.Hello(idle.session, "wire")).ok
        assert _ask(idle, A, 3) == _expected(A, 3)                        # the session kept its contexts
        for w in (stay, idle):
            w.close()
    finally:
        stop.set()
        thread.join(30)
        ctx.term()


def test_a_prepared_propose_whose_session_ended_in_the_same_round_is_not_drafted():
    """A target whose socket was rebuilt says hello again with its session key on a new connection;
    a bye on the new one, handled in the same round as the old one's propose (its rows already stored),
    released the session's states, and the propose still ran on them (their pool blocks perhaps
    another client's by then). It is answered like any message of an ended session: NO_SESSION."""
    import zmq

    from helpers.service import LocalService
    from helpers.wire import _rows
    from k3_accel.server.gather import Gather
    from k3_accel.server.loop import ServerLoop

    local = LocalService()
    ctx = zmq.Context()
    loop = ServerLoop(local.service, ["tcp://127.0.0.1:0"], 1 << 26, ctx=ctx, gather=Gather(0))

    def arrive(n: int) -> None:          # the loop driven by hand: every message of a round is queued first
        deadline = time.monotonic() + 60
        while sum(len(c.queue) for c in loop._conns.values()) < n:
            assert time.monotonic() < deadline, "the messages never reached the server"
            if loop.sock.poll(100):
                loop._receive_all()

    def hello(w: Wire) -> None:
        w.send(p.Hello(w.session, "wire"))
        arrive(1)
        loop._round()
        assert w.recv().ok

    old = Wire(loop.endpoints[0], hello=False)
    new = Wire(loop.endpoints[0], session=old.session, hello=False)
    other = Wire(loop.endpoints[0], hello=False)
    try:
        for w in (old, new, other):
            hello(w)
        old.send_propose(K, [(0, 0, [1, 2, 3, 1, 2], 3)])
        new.send(p.Bye())
        other.send(*_rows(p.Ingest, [(0, 0, [7, 8, 9, 7, 8, 9])], None))
        arrive(3)
        for _ in range(3):
            loop._round()
        assert new.recv().ok and other.recv().ok
        reply = old.recv()
        assert not reply.ok and reply.error[0] == "NO_SESSION"
        assert local.service.metrics.engine_batches == 0 and not local.store.in_flight
        local.check_pool()
    finally:
        loop.sock.close(linger=0)
        for w in (old, new, other):
            w.close()
        ctx.term()
