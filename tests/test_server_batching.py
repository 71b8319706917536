"""Scheduling over real sockets: cross-client batching, per-client order, shutdown with messages queued.

Messages are queued for real: the server is paused (SIGSTOP), clients send,
and the test waits until the bytes sit in the server's kernel receive queue
before it lets the server go on.
"""
from __future__ import annotations

import signal
import time

import pytest

from helpers.oracles import ngram_lookup
from helpers.server import ServerProcess
from helpers.wire import Wire
from k3_accel import protocol as p

K = 3


def lookup(history) -> list[int]:
    found = ngram_lookup(history, K)
    return found + [-1] * (K - len(found))


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "ngram", "--block-size", "4", "--lease-s", "0")
    yield s
    assert s.stop() == 0


def _contexts(i: int) -> dict[int, list[int]]:
    """Client i's two requests: histories that differ from every other client's."""
    return {0: [i, i + 10, i + 20, i, i + 10], 1: [i + 30, i + 30, i + 40]}


def test_waiting_proposes_of_several_clients_run_as_one_engine_batch(server):
    """Four clients send two proposes each while the server is paused; one of them has a
    request with a context gap and one a message the server refuses whole. Each client gets
    its replies in its own order, with drafts from its own history; the others are unaffected;
    proposes that waited together ran together."""
    clients = [Wire(server.address) for _ in range(4)]
    observer = Wire(server.address)
    try:
        for i, w in enumerate(clients):
            w.ingest([(h, 0, toks) for h, toks in _contexts(i).items()]).raise_for_error()
        deadline = time.monotonic() + 120
        while True:
            before = observer.call(p.Stats()).result
            server.pause()
            sent, expected = 0, []
            for i, w in enumerate(clients):
                ctx, want = _contexts(i), []
                a0, a1 = i + 20, i + 30
                if i == 1:                                # a refused message, then a fine one
                    sent += w.send_propose(K + 100, [(0, 5, [], a0)])
                    want.append(("K_TOO_LARGE", None))
                else:
                    sent += w.send_propose(K, [(0, 5, [], a0), (1, 3, [], a1)])
                    want.append((None, [lookup(ctx[0] + [a0]), lookup(ctx[1] + [a1])]))
                if i == 2:                                # one request of the batch is bad
                    sent += w.send_propose(K, [(0, 9, [7], a0), (1, 3, [], a1)])
                    want.append((None, [[-1] * K, lookup(ctx[1] + [a1])]))
                else:
                    sent += w.send_propose(K, [(1, 3, [], a0)])
                    want.append((None, [lookup(ctx[1] + [a0])]))
                expected.append(want)
            server.wait_queued(sent)
            server.resume()
            replies = []
            for w, want in zip(clients, expected):
                first_seq = w.seq - len(want) + 1
                for n, (code, drafts) in enumerate(want):
                    reply = w.recv()
                    replies.append(reply)
                    assert reply.seq == first_seq + n                 # the client's own order
                    if code:
                        assert not reply.ok and reply.error[0] == code
                    else:
                        assert reply.ok and reply.tensors["drafts"].tolist() == drafts
            assert [r.failures for r in replies if r.failures] == [[(0, "CONTEXT_GAP", _gap_text(replies))]]
            after = observer.call(p.Stats()).result
            batches = after["engine_batches"] - before["engine_batches"]
            messages = after["ops"]["propose"] - before["ops"].get("propose", 0) - 1   # one never reached the engine
            assert 1 <= batches <= messages == 7
            if batches < messages:
                break
            # the server woke up before every message was read; that is allowed, try again
            assert time.monotonic() < deadline, "proposes waiting together never ran as one batch"
    finally:
        for w in (*clients, observer):
            w.close()


def _gap_text(replies) -> str:
    return next(f[2] for r in replies for f in r.failures)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_answers_every_queued_message(sig):
    """Messages queued when the stop signal comes are answered SHUTTING_DOWN, in order."""
    server = ServerProcess("--engine", "ngram")
    clients = [Wire(server.address) for _ in range(3)]
    try:
        for w in clients:
            w.ingest([(0, 0, [1, 2, 3, 1, 2])]).raise_for_error()
        server.pause()
        sent = 0
        for w in clients:
            sent += w.send_propose(K, [(0, 5, [], 3)])
            sent += w.send(p.Stats())
            sent += w.send(p.Free([0]))
            w.send_frames([b"junk"])                     # a message refused at decoding, in line with the rest
            sent += 2 + 4
            sent += w.send(p.Ping())
        server.wait_queued(sent)
        server.proc.send_signal(sig)                     # pending while stopped: it lands as the server wakes
        server.resume()
        codes = []
        for w in clients:
            seqs = []
            for _ in range(5):
                reply = w.recv()
                seqs.append(reply.seq)
                assert reply.ok or reply.error[0] in ("SHUTTING_DOWN", "BAD_FRAME"), reply.error
                codes.append(reply.error[0] if not reply.ok else "ok")
            assert seqs == [w.seq - 3, w.seq - 2, w.seq - 1, -1, w.seq]     # in the order sent
        # at most the head of each connection may have been handled before the signal was seen
        assert codes.count("SHUTTING_DOWN") >= len(codes) - len(clients)
        assert server.proc.wait(60) == 0
    finally:
        for w in clients:
            w.close()
        server.stop()
