"""Hostile and broken input over real sockets: typed errors, the server stays up, and no
state changes (the sender's own session included) for a message that is refused."""
from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from helpers.server import ServerProcess
from helpers.wire import Wire, ints, meta
from k3_accel import protocol as p

KEEP = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
MIB = 1 << 20


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "ngram", "--block-size", "4", "--max-message-mb", "1", "--lease-s", "0")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def bystander(server):
    """Another client's session, which nothing in this module may disturb."""
    w = Wire(server.address)
    w.ingest([(0, 0, KEEP)]).raise_for_error()
    yield w
    w.close()


@pytest.fixture
def wire(server):
    w = Wire(server.address)
    w.ingest([(0, 0, KEEP), (1, 0, KEEP[:5])]).raise_for_error()
    yield w
    w.close()


def head(*h) -> bytes:
    return msgspec.msgpack.encode(list(h))


def observe(w: Wire, bystander: Wire) -> tuple:
    """What a refused message must leave as it was: both sessions' lines, the pool, their drafts."""
    s = w.call(p.Stats()).raise_for_error().result
    lines = {name: {k: v for k, v in line.items() if k != "idle_s"} for name, line in s["sessions"].items()}
    mine = w.propose(3, [(0, len(KEEP), [], 1), (1, 5, [], 1)]).raise_for_error().tensors["drafts"].tolist()
    theirs = bystander.propose(3, [(0, len(KEEP), [], 1)]).raise_for_error().tensors["drafts"].tolist()
    return lines, s["active"], s["retained"], s["pool_free_blocks"], mine, theirs


BIG = 2 ** 63 - 1
HOSTILE = {
    "not msgpack": ([b"\xc1\xc1 not msgpack"], "BAD_FRAME"),
    "not an array": ([msgpack.packb({"a": 1})], "BAD_FRAME"),
    "short header": ([head(2, 7)], "BAD_FRAME"),
    "negative seq": ([head(2, -7, ["ping"])], "BAD_FIELD"),
    "other version": ([head(3, 7, ["stats"])], "BAD_VERSION"),
    "unknown op": ([head(2, 7, ["explode"])], "UNKNOWN_OP"),
    "missing field": ([head(2, 7, ["free"])], "BAD_FIELD"),
    "extra field": ([head(2, 7, ["free", [0], False, 1])], "BAD_FIELD"),
    "mistyped field": ([head(2, 7, ["propose", "4", 1, 1])], "BAD_FIELD"),
    "bool for int": ([head(2, 7, ["free", [True]])], "BAD_FIELD"),
    "missing frame": ([head(2, 7, ["ingest", 1, 2]), meta([0], [11], [2])], "FRAME_MISMATCH"),
    "extra frame": ([head(2, 7, ["clear"]), b"x"], "FRAME_MISMATCH"),
    "short frame": ([head(2, 7, ["ingest", 1, 2]), meta([0], [11], [2]), b"\0" * 15], "FRAME_MISMATCH"),
    "meta vs n": ([head(2, 7, ["ingest", 1, 2]), meta([0, 1], [11, 5], [1, 1]), ints([1, 2])], "FRAME_MISMATCH"),
    "counts vs rows": ([head(2, 7, ["ingest", 1, 2]), meta([0], [0], [3]), ints([1, 2])], "FRAME_MISMATCH"),
    "counts that overflow": ([head(2, 7, ["ingest", 3, 0]),
                              np.array([[0, 0, BIG], [1, 0, BIG], [2, 0, 2]], dtype=np.int64).data, b""],
                             "FRAME_MISMATCH"),
    "negative count": ([head(2, 7, ["ingest", 2, 1]), meta([0, 1], [11, 5], [-1, 2]), ints([1])], "BAD_FIELD"),
    "negative start": ([head(2, 7, ["ingest", 1, 1]), meta([0], [-1], [1]), ints([1])], "BAD_FIELD"),
    "negative handle": ([head(2, 7, ["propose", 2, 1, 0]), meta([-1], [0], [0], [1]), ints([])], "BAD_FIELD"),
    "same handle twice": ([head(2, 7, ["ingest", 2, 2]), meta([0, 0], [0, 1], [1, 1]), ints([1, 2])],
                          "BAD_REQUEST"),
    "hidden rows to ngram": ([head(2, 7, ["ingest", 1, 1, "float32", 2]), meta([0], [0], [1]), ints([1]),
                              b"\0" * 8], "BAD_REQUEST"),
    "hidden dtype": ([head(2, 7, ["ingest", 1, 1, "float64", 1]), meta([0], [0], [1]), ints([1]), b"\0" * 8],
                     "BAD_FIELD"),
    "declared hidden too large": ([head(2, 7, ["ingest", 1, 1, "float32", MIB]), meta([0], [0], [1]),
                                   ints([1]), b""], "TOO_LARGE"),
    "message over the limit": ([head(2, 7, ["ingest", 1, MIB // 8 + 64]), meta([0], [0], [MIB // 8 + 64]),
                                ints([1] * (MIB // 8 + 64))], "TOO_LARGE"),
    "k too large": ([head(2, 7, ["propose", 99, 1, 0]), meta([0], [11], [0], [1]), ints([])], "K_TOO_LARGE"),
    "negative k": ([head(2, 7, ["propose", -1, 1, 0]), meta([0], [11], [0], [1]), ints([])], "K_TOO_LARGE"),
    "logits mode": ([head(2, 7, ["propose", 2, 1, 0, "", 0, "all"]), meta([0], [11], [0], [1]), ints([])],
                    "BAD_FIELD"),
    "reconnect handle": ([head(2, 7, ["reconnect", -1, 2]), ints([3, 1])], "BAD_FIELD"),
    "reconnect tokens": ([head(2, 7, ["reconnect", 1, 2]), ints([3, -1])], "BAD_REQUEST"),
    "reconnect frame": ([head(2, 7, ["reconnect", 1, 2]), ints([3])], "FRAME_MISMATCH"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_message_gets_a_typed_error_and_changes_nothing(wire, bystander, case):
    frames, code = HOSTILE[case]
    before = observe(wire, bystander)
    wire.send_frames([bytes(f) for f in frames])
    reply = wire.recv()
    assert not reply.ok and reply.error[0] == code, reply.error
    assert reply.server_id and reply.seq in (7, -1, -7)
    assert observe(wire, bystander) == before


def test_error_reply_echoes_the_seq(wire):
    for seq in (0, 4242, 2 ** 40):
        wire.send_frames([head(2, seq, ["explode"])])
        reply = wire.recv()
        assert reply.seq == seq and reply.error[0] == "UNKNOWN_OP"


def test_a_v1_client_gets_bad_version_in_v1_framing(server, bystander):
    w = Wire(server.address, hello=False)
    try:
        w.send_frames([msgpack.packb({"v": 1, "op": "hello", "seq": 5, "body": {"client": "old"}, "tensors": []})])
        assert w.sock.poll(60000)
        frames = w.sock.recv_multipart()
        reply = msgpack.unpackb(frames[0])
        assert len(frames) == 1 and reply["v"] == 1 and reply["seq"] == 5
        error = reply["body"]["error"]
        assert reply["body"]["ok"] is False and error["code"] == "BAD_VERSION"
        assert "speaks 2" in error["message"] and "upgrade" in error["message"]
        assert w.call(p.Hello("v" * 32)).ok                         # the same socket may speak v2
    finally:
        w.close()
    assert bystander.call(p.Ping()).ok


def test_a_frame_over_the_socket_limit_drops_only_that_connection(server, wire, bystander):
    """Over MAXMSGSIZE libzmq drops the sender's connection without a reply; the server lives,
    and the sender's session survives for its next connection."""
    before = observe(wire, bystander)
    wire.send_frames([head(2, 9, ["stats"]), b"x" * (3 * MIB)])
    assert not wire.sock.poll(2000), "an over-limit frame got a reply"
    reply = wire.call(p.Stats())          # ZMQ reconnected: a new connection, not bound to a session yet
    assert not reply.ok and reply.error[0] == "NO_SESSION"
    assert wire.call(p.Hello(wire.session, "again")).ok
    assert observe(wire, bystander) == before
