"""Holding a round's proposes for targets expected back (``server/gather.py``), on a clock the test moves.

The rule a user relies on: several targets that step in a loop share an engine call instead of
taking turns, while a lone target, a target whose steps are far apart, or one that stopped coming
never makes another wait, and no round is held longer than the limit (the window, at most a share
of the engine's call time). Unit tests on the policy, then the real server loop on real sockets
with the policy's clock in the test's hands, so nothing depends on how fast this machine is.
"""
from __future__ import annotations

import math
import threading

import pytest
import zmq

from helpers.oracles import ngram_lookup
from helpers.steps import wait_until
from helpers.wire import Wire
from k3_accel import protocol as p
from k3_accel.server.engines.ngram import NgramEngine
from k3_accel.server.gather import Gather
from k3_accel.server.loop import ServerLoop
from k3_accel.server.metrics import ServerMetrics
from k3_accel.server.service import DraftService
from k3_accel.server.state import RequestStore

MS = 1e-3
EPS = 1e-9          # clock arithmetic in binary floating point


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def in_step(g: Gather, clock: Clock, keys: list[str], turn: float) -> None:
    """Every session proposes and is answered together, then comes back ``turn`` later, twice."""
    for _ in range(2):
        for k in keys:
            g.arrived(k)
        assert g.wait_s(keys) == 0
        for k in keys:
            g.answered(k)
        clock.t += turn


# ------------------------------------------------------------------ the policy
def test_a_lone_session_never_waits():
    clock = Clock()
    g = Gather(1.0, clock=clock)
    for _ in range(5):
        g.arrived("a")
        assert g.wait_s(["a"]) == 0
        g.answered("a")
        clock.t += 0.2 * MS
    assert g.held_s is None and g.held_since is None


def test_a_round_waits_for_a_session_due_back_and_runs_once_it_is_here():
    clock = Clock()
    g = Gather(1.0 * MS, clock=clock)
    in_step(g, clock, ["a", "b"], 0.3 * MS)
    # the groups split: a is answered, b arrives before a is back
    g.arrived("a")
    g.answered("a")
    clock.t += 0.1 * MS
    g.arrived("b")
    wait = g.wait_s(["b"])
    assert 0 < wait <= g.limit + EPS
    clock.t += 0.1 * MS
    assert g.wait_s(["b"]) > 0                      # still due
    g.arrived("a")
    assert g.wait_s(["a", "b"]) == 0                # everyone expected is here: run
    assert g.held_s == pytest.approx(0.1 * MS, abs=EPS)


def test_no_round_is_held_past_the_limit():
    clock = Clock()
    g = Gather(0.5 * MS, clock=clock)
    in_step(g, clock, ["a", "b", "c"], 0.4 * MS)
    for k in "abc":
        g.arrived(k)
    assert g.wait_s("abc") == 0
    for k in "abc":
        g.answered(k)
    g.arrived("c")              # at once: a and b are due 0.4 ms on, late only after the 0.5 ms limit
    start, held = clock.t, []
    while (w := g.wait_s(["c"])) > 0:
        assert clock.t + w <= start + g.limit + EPS        # never asks to be held past the limit
        held.append(w)
        clock.t += 0.05 * MS
    assert held, "c was never held for a and b"
    assert clock.t - start <= g.limit + EPS
    assert 0 < g.held_s <= g.limit + EPS


def test_the_limit_is_at_most_a_share_of_the_engine_call():
    g = Gather(1.0 * MS, share=0.5)
    assert g.limit == 1.0 * MS                       # nothing measured yet: the window
    g.engine(0.4 * MS)
    assert g.limit == pytest.approx(0.2 * MS)
    g.engine(10 * MS)
    assert g.limit == 1.0 * MS


@pytest.mark.parametrize("step_ms", [5, 12, 30])
def test_a_session_whose_steps_are_far_apart_is_never_waited_for(step_ms):
    """A vLLM target runs a forward between its proposes: even when its next one is due within
    the wait, another target's round is not held for it."""
    clock = Clock()
    g = Gather(1.0 * MS, clock=clock)
    in_step(g, clock, ["slow", "b"], step_ms * MS)
    for before_due_ms in (step_ms, 0.5, 0.1):        # b comes early in slow's step, then just before it is due
        g.answered("slow")
        clock.t += (step_ms - before_due_ms) * MS
        g.arrived("b")
        assert g.wait_s(["b"]) == 0
        g.answered("b")
        clock.t += before_due_ms * MS
        g.arrived("slow")


def test_a_session_that_does_not_come_back_is_waited_for_once_then_not_until_it_returns():
    clock = Clock()
    g = Gather(1.0 * MS, clock=clock)
    in_step(g, clock, ["gone", "b"], 0.2 * MS)
    g.answered("gone")
    g.arrived("b")
    while g.wait_s(["b"]) > 0:
        clock.t += 0.05 * MS
    g.answered("b")
    for _ in range(3):                               # b goes on alone: not held for "gone" again
        clock.t += 0.2 * MS
        g.arrived("b")
        assert g.wait_s(["b"]) == 0
        g.answered("b")
    g.arrived("gone")                                # back: expected again from its next reply
    g.arrived("b")
    assert g.wait_s(["gone", "b"]) == 0
    g.answered("gone")
    g.answered("b")
    clock.t += 0.2 * MS
    g.arrived("b")
    assert g.wait_s(["b"]) > 0


def test_a_propose_here_whose_rows_are_still_on_their_way_is_waited_for_up_to_the_limit():
    clock = Clock()
    g = Gather(1.0 * MS, clock=clock)
    g.arrived("a")
    g.arrived("b")
    assert 0 < g.wait_s(["a"], pending=["b"]) <= 1.0 * MS + EPS
    clock.t += 1.0 * MS
    assert g.wait_s(["a"], pending=["b"]) == 0


def test_housekeeping_does_not_forget_a_session_whose_first_propose_is_here():
    """The loop's housekeeping forgets sessions silent for FORGET_S; one whose first propose just
    arrived (never answered yet) is not silent: its rows on their way are still waited for."""
    clock = Clock()
    g = Gather(1.0 * MS, clock=clock)
    g.arrived("a")
    g.arrived("b")
    g.forget()                                        # housekeeping runs between the loop's rounds
    assert 0 < g.wait_s(["a"], pending=["b"]) <= 1.0 * MS + EPS
    clock.t += 61.0                                   # silent past FORGET_S: forgotten then
    g.forget()
    assert g.wait_s(["a"], pending=["b"]) == 0


def test_a_propose_whose_rows_never_come_is_not_waited_for_again():
    """A target that died mid-step leaves a propose whose device read never completes: a round
    is not held for it once it has been pending longer than the limit."""
    clock = Clock()
    g = Gather(1.0 * MS, clock=clock)
    g.arrived("dead")
    clock.t += 0.5 * MS
    g.arrived("a")
    assert g.wait_s(["a"], pending=["dead"]) > 0      # young: its rows may be microseconds away
    clock.t += 0.5 * MS
    assert g.wait_s(["a"], pending=["dead"]) == 0     # the limit: the round runs
    g.answered("a")
    for _ in range(3):                                # later rounds: never held for it again
        clock.t += 0.3 * MS
        g.arrived("a")
        assert g.wait_s(["a"], pending=["dead"]) == 0
        g.answered("a")


def test_no_wait_at_all_when_switched_off():
    clock = Clock()
    g = Gather(0.0, clock=clock)
    in_step(g, clock, ["a", "b"], 0.1 * MS)
    g.answered("a")
    g.arrived("b")
    assert g.wait_s(["b"], pending=["a"]) == 0


@pytest.mark.parametrize("window, share", [(-1.0, 0.5), (1.0, -0.1)])
def test_a_negative_wait_or_share_is_refused(window, share):
    with pytest.raises(ValueError):
        Gather(window, share)


def test_the_server_refuses_a_negative_batch_wait():
    from k3_accel.server.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--batch-wait-ms", "-1"])
    assert build_parser().parse_args([]).batch_wait_ms > 0


# ------------------------------------------------------------ the real loop
K = 3


@pytest.fixture
def loop_on_test_clock():
    clock = Clock()
    engine = NgramEngine(max_spec_tokens=8, budget_bytes=1 << 24)
    service = DraftService(engine, RequestStore(engine, max_requests=16, max_requests_total=64, max_retained=0),
                           ServerMetrics())
    ctx = zmq.Context()
    # the share is infinite so that only the test's clock decides (the engine's call time is real time)
    loop = ServerLoop(service, ["tcp://127.0.0.1:0"], 1 << 26, ctx=ctx, gather=Gather(10.0, math.inf, clock))
    stop = threading.Event()
    thread = threading.Thread(target=loop.serve, args=(stop,), daemon=True)
    thread.start()
    assert loop.ready.wait(30)
    yield loop, clock
    stop.set()
    thread.join(30)
    ctx.term()


def _drafts(w: Wire, clock: Clock) -> list[list[int]]:
    """The reply's drafts; while none has come, move the test's clock on (that only ends holds), by
    less than a target's slack, so that a reply the machine was slow to deliver ends no hold."""
    while not w.sock.poll(50):
        clock.t += 0.2 * MS
    reply = w.recv()
    assert reply.ok and not reply.failures, reply.error
    return reply.tensors["drafts"].tolist()


def test_two_targets_taking_turns_end_up_in_one_engine_call(loop_on_test_clock):
    """Target b's propose arrives while a, which steps in a loop with it, is between steps: the
    loop holds b until a's propose comes, answers both from one engine call with each target's
    own drafts, and meanwhile answers other messages."""
    loop, clock = loop_on_test_clock
    stats = loop.service.metrics
    a, b, observer = Wire(loop.endpoints[0]), Wire(loop.endpoints[0]), Wire(loop.endpoints[0])
    ctx = {"a": [1, 2, 3, 1, 2, 4, 1], "b": [7, 8, 9, 7, 8, 6, 9]}
    anchors = [2, 3, 1, 9, 7]
    wires = {"a": a, "b": b}

    def send(name: str, anchor: int) -> None:
        wires[name].send_propose(K, [(0, len(ctx[name]), [], anchor)])

    try:
        for name, w in wires.items():
            w.ingest([(0, 0, ctx[name])]).raise_for_error()
        for anchor in anchors[:3]:                 # both step together, 1 ms apart on the test's clock
            for name in wires:
                send(name, anchor)
            for name, w in wires.items():
                assert _drafts(w, clock) == [_lookup(ctx[name] + [anchor])]
            clock.t += 1 * MS
        send("a", anchors[3])                      # a alone: run (perhaps after holding it for b)
        assert _drafts(a, clock) == [_lookup(ctx["a"] + [anchors[3]])]
        batches, held = stats.engine_batches, stats.batches_held
        b.send_propose(K, [(0, len(ctx["b"]), [8], anchors[3])])   # b, with a just answered and due back
        ctx["b"].append(8)
        assert wait_until(lambda: loop.gather.held_since is not None, timeout=60)
        assert observer.call(p.Ping()).ok          # other messages go on while b is held
        assert not b.sock.poll(200), "b was answered without waiting for a, which is due back"
        assert stats.engine_batches == batches
        # held, b's row is already stored: only the engine call is left once a comes
        assert _context_length(loop, b) == len(ctx["b"])
        send("a", anchors[4])
        assert _drafts(a, clock) == [_lookup(ctx["a"] + [anchors[4]])]
        assert _drafts(b, clock) == [_lookup(ctx["b"] + [anchors[3]])]
        assert stats.engine_batches == batches + 1 and stats.batches_held == held + 1
        send("b", anchors[4])                      # a stays away now: b is held only until a is overdue
        assert _drafts(b, clock) == [_lookup(ctx["b"] + [anchors[4]])]
        assert stats.engine_batches == batches + 2
    finally:
        for w in (a, b, observer):
            w.close()


def test_a_held_propose_whose_session_ends_is_dropped_and_the_others_go_on(loop_on_test_clock):
    """b's propose is held (a is due back); b's session then ends through another connection's
    bye: b is answered NO_SESSION, nothing it admitted stays protected, and a drafts as before."""
    loop, clock = loop_on_test_clock
    a, b = Wire(loop.endpoints[0]), Wire(loop.endpoints[0])
    ctx = {"a": [1, 2, 3, 1, 2], "b": [7, 8, 9, 7, 8]}
    wires = {"a": a, "b": b}
    try:
        for name, w in wires.items():
            w.ingest([(0, 0, ctx[name])]).raise_for_error()
        for anchor in (1, 2, 3):
            for name, w in wires.items():
                w.send_propose(K, [(0, len(ctx[name]), [], anchor)])
            for name, w in wires.items():
                assert _drafts(w, clock) == [_lookup(ctx[name] + [anchor])]
            clock.t += 1 * MS
        a.send_propose(K, [(0, len(ctx["a"]), [], 1)])
        assert _drafts(a, clock) == [_lookup(ctx["a"] + [1])]
        b.send_propose(K, [(0, len(ctx["b"]), [9], 7)])
        assert wait_until(lambda: loop.gather.held_since is not None, timeout=60)
        assert loop.service.store.in_flight, "the held propose's states are not protected"
        other = Wire(loop.endpoints[0], session=b.session)      # the same session, another connection
        assert other.call(p.Bye()).ok
        other.close()
        reply = b.recv()
        assert not reply.ok and reply.error[0] == "NO_SESSION"
        assert wait_until(lambda: not loop.service.store.in_flight, timeout=60)
        held = loop.service.metrics.batches_held
        a.send_propose(K, [(0, len(ctx["a"]), [], 2)])
        assert _drafts(a, clock) == [_lookup(ctx["a"] + [2])]
        assert loop.service.metrics.batches_held == held    # a ran at once: b's hold is over, not a's
    finally:
        a.close()
        b.close()


def _context_length(loop: ServerLoop, w: Wire) -> int:
    return loop.service.store.lookup(loop.service.store.sessions[w.session], 0).length


def _lookup(history: list[int]) -> list[int]:
    found = ngram_lookup(history, K)
    return found + [-1] * (K - len(found))
