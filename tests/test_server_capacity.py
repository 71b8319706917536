"""Capacity over real sockets: request limits and the context pool, refused per request."""
from __future__ import annotations

import pytest

from helpers.server import ServerProcess
from helpers.wire import Wire
from k3_accel import protocol as p

TOTAL = 5


@pytest.fixture(scope="module")
def server():
    # a 1 MiB pool of 16-row blocks; --max-requests is left at its default (1024)
    s = ServerProcess("--engine", "ngram", "--memory-budget-mb", "1", "--block-size", "16",
                      "--max-requests-total", str(TOTAL), "--max-retained-requests", "4", "--lease-s", "0")
    yield s
    assert s.stop() == 0


@pytest.fixture
def wires(server):
    opened = []

    def make() -> Wire:
        opened.append(Wire(server.address))
        return opened[-1]
    yield make
    for w in opened:
        w.call(p.Bye())
        w.close()


def stats(w: Wire) -> dict:
    return w.call(p.Stats()).raise_for_error().result


def failed(reply: p.Reply) -> dict[int, str]:
    assert reply.ok, reply.error
    return {i: code for i, code, _ in reply.failures}


def test_caps_advertise_what_the_server_enforces(wires):
    caps = wires().caps
    assert caps.max_requests_total == TOTAL
    assert caps.max_requests == TOTAL          # a session can never hold more than the server does
    assert caps.pool_blocks == (1 << 20) // (16 * 32) and caps.block_size == 16


def test_total_limit_refuses_per_request_across_sessions(wires):
    b, c = wires(), wires()
    assert failed(b.ingest([(h, 0, [1, 2]) for h in range(3)])) == {}
    reply = c.ingest([(0, 0, [3]), (1, 0, [4]), (2, 0, [5])])
    assert failed(reply) == {2: "TOO_MANY_REQUESTS"} and "on the server" in reply.failures[0][2]
    assert failed(c.ingest([(0, 1, [6])])) == {}                       # active requests go on
    b.call(p.Free([0], retain=False)).raise_for_error()
    assert failed(c.ingest([(2, 0, [5])])) == {}
    assert stats(c)["active"] == TOTAL


def test_pool_refuses_exactly_at_its_size_and_evicts_retained_contexts_first(wires):
    w = wires()
    caps = w.caps
    rows = caps.pool_blocks * caps.block_size
    assert stats(w)["pool_free_blocks"] == caps.pool_blocks            # (nothing else holds blocks)
    assert failed(w.ingest([(0, 0, [1] * (rows - caps.block_size)), (1, 0, [2] * (caps.block_size - 1))])) == {}
    assert stats(w)["pool_free_blocks"] == 0
    # one more row fits in the last block; the next one needs a block nobody has
    assert failed(w.ingest([(1, caps.block_size - 1, [2])])) == {}
    reply = w.ingest([(2, 0, [3]), (1, caps.block_size, [2]), (1 << 40, 0, [4])])
    assert failed(reply) == {0: "CAPACITY", 1: "CAPACITY", 2: "CAPACITY"}
    assert "--memory-budget-mb" in reply.failures[0][2]
    # in the same message as refused ones, a request that needs no new block goes through
    assert failed(w.ingest([(2, 0, [3]), (1, 3, [9])])) == {0: "CAPACITY"}
    # a retained context gives its blocks back before anything is refused
    w.call(p.Free([0])).raise_for_error()
    assert stats(w)["retained"] == 1
    assert failed(w.ingest([(2, 0, [3] * 40)])) == {}
    s = stats(w)
    assert s["retained"] == 0 and s["sessions"][s["session"]]["blocks"] == 1 + 3
    assert w.propose(2, [(1, 4, [], 2)]).raise_for_error().failures == []   # the server lives on
