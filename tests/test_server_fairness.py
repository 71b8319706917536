"""One target cannot starve the others (issue 26): each session's fair share of the draft pool,
over real sockets, on the n-gram and DFlash engines (CPU, a 1 MiB pool).

A busy session may borrow all the room the others leave; a session within its share that needs
room gets it back from the sessions over theirs (their retained contexts first, then their newest
active requests, whose next rows get ``CAPACITY``), and never the other way round.
"""
from __future__ import annotations

import random

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dflash_support import checkpoint
from helpers.server import ServerProcess
from helpers.steps import wait_until
from helpers.wire import Wire
from k3_accel import protocol as p

K = 3
SERVER_FLAGS = ("--memory-budget-mb", "1", "--lease-s", "0", "--max-retained-requests", "8",
                "--num-speculative-tokens", str(K))


@pytest.fixture(scope="module", params=["ngram", "dflash"])
def server(request, tmp_path_factory):
    if request.param == "ngram":     # 1 MiB of 64-row blocks of 32 bytes a row: 512 blocks
        s = ServerProcess("--engine", "ngram", "--block-size", "64", *SERVER_FLAGS)
    else:                            # the tiny draft's fp32 K/V: 1 KiB a row, 64 blocks of 16 rows
        draft, target = checkpoint(tmp_path_factory.mktemp("fair-dflash"))
        s = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                          "--block-size", "16", *SERVER_FLAGS)
    yield s
    assert s.stop() == 0


class Target:
    """One client session: rows with seeded hidden rows when the engine needs them."""

    def __init__(self, server: ServerProcess):
        self.wire = Wire(server.address)
        self.caps = self.wire.caps
        self.width = self.caps.context_width
        self.gen = torch.Generator().manual_seed(0)

    def _hidden(self, spans) -> torch.Tensor | None:
        rows = sum(len(s[2]) for s in spans)
        if not self.width or not rows:
            return None
        return torch.randn(rows, self.width, generator=self.gen).to(torch.bfloat16)

    def ingest(self, spans) -> p.Reply:
        return self.wire.ingest(spans, hidden=self._hidden(spans)).raise_for_error()

    def propose(self, spans) -> p.Reply:
        return self.wire.propose(K, spans, hidden=self._hidden(spans)).raise_for_error()

    def stats(self) -> dict:
        return self.wire.call(p.Stats()).raise_for_error().result

    def mine(self) -> dict:
        s = self.stats()
        return s["sessions"][s["session"]]

    def close(self) -> None:
        if self.wire is not None:
            self.wire.call(p.Bye())
            self.wire.close()
            self.wire = None


@pytest.fixture
def targets(server):
    opened: list[Target] = []

    def make() -> Target:
        opened.append(Target(server))
        return opened[-1]
    yield make
    for t in opened:
        t.close()


def failed(reply: p.Reply) -> dict[int, str]:
    return {i: code for i, code, _ in reply.failures}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(12) for _ in range(n)]


def fill(t: Target, rows: int, first: int = 0) -> list[int]:
    """New requests of ``rows`` rows each until the pool refuses one; the handles it holds."""
    rng, held = random.Random(first), []
    for handle in range(first, first + t.caps.pool_blocks + 1):
        if failed(t.ingest([(handle, 0, tokens(rng, rows))])):
            return held
        held.append(handle)
    raise AssertionError("the pool never filled")


def replay(t: Target, script: list, between=lambda: None) -> list:
    """A fixed sequence of ingests and proposes; each reply's failures and drafts."""
    out = []
    for op, spans in script:
        between()
        reply = t.ingest(spans) if op == "ingest" else t.propose(spans)
        out.append((failed(reply), reply.tensors["drafts"].tolist() if op == "propose" else None))
    return out


def b_script(caps: p.Caps, requests: int = 3, decode_steps: int = 8) -> list:
    """Seeded prefill chunks and decode steps of ``requests`` requests that together stay within
    half the pool (the share of one of two sessions)."""
    per = (caps.pool_blocks // 2 // requests - 1) * caps.block_size
    rng = random.Random(26)
    ctx = {h: tokens(rng, per) for h in range(requests)}
    prefill = per - decode_steps
    half = prefill // 2
    script = [("ingest", [(h, 0, ctx[h][:half]) for h in ctx]),
              ("propose", [(h, half, ctx[h][half:prefill], ctx[h][prefill]) for h in ctx])]
    for step in range(decode_steps - 1):
        at = prefill + step
        script.append(("propose", [(h, at, [ctx[h][at]], ctx[h][at + 1]) for h in ctx]))
    return script


def metric(server: ServerProcess, name: str, **labels) -> float | None:
    """A sample of ``/metrics`` (gauges catch up within the server's housekeeping interval)."""
    for family in text_string_to_metric_families(server.metrics()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_one_session_cannot_starve_another(server, targets):
    alone = targets()
    script = b_script(alone.caps)
    want = replay(alone, script)
    assert all(f == {} for f, _ in want) and any(d and max(map(max, d)) >= 0 for _, d in want)
    alone.close()

    a = targets()
    rows = 3 * a.caps.block_size + 8                     # a few blocks and a partial one a request
    held = fill(a, rows)
    assert a.stats()["pool_free_blocks"] < rows // a.caps.block_size + 1
    refused, next_handle = [], [10_000]

    def a_keeps_pushing():                               # a new request before each of b's messages
        reply = a.ingest([(next_handle[0], 0, [1] * rows)])
        next_handle[0] += 1
        refused.append(bool(failed(reply)))

    b = targets()
    got = replay(b, script, between=a_keeps_pushing)
    assert got == want                                   # every step drafted, the same drafts as alone
    assert any(refused)                                  # a kept asking, and was refused
    mine_a, mine_b = a.mine(), b.mine()
    assert mine_a["gave_back"].get("active", 0) >= 1 and "active" not in mine_b["gave_back"]
    assert mine_b["blocks"] <= mine_b["share_blocks"] == a.caps.pool_blocks // 2
    assert mine_a["blocks"] + mine_b["blocks"] == a.caps.pool_blocks - a.stats()["pool_free_blocks"]
    assert held                                          # (a held the whole pool before b came)


def test_over_share_requests_give_way_first(server, targets):
    a = targets()
    caps, r = a.caps, a.caps.block_size
    per = 4                                              # blocks a request of a's holds
    n = caps.pool_blocks // per
    rng = random.Random(5)
    ctx = {h: tokens(rng, per * r) for h in range(n)}
    for h in range(n):
        assert failed(a.ingest([(h, 0, ctx[h])])) == {}
    a.wire.call(p.Free([0, 1])).raise_for_error()       # retained: reconnect sources
    assert a.stats()["pool_free_blocks"] == 0 and a.mine()["retained"] == 2

    b = targets()
    need = 3 * per                                       # within b's share (half the pool)
    assert failed(b.ingest([(h, 0, tokens(rng, per * r)) for h in range(3)])) == {}
    mine = a.mine()
    assert mine["retained"] == 0                         # a's retained contexts went first ...
    assert mine["gave_back"] == {"retained": 2, "active": (need - 2 * per) // per}
    evicted = list(range(n - (need - 2 * per) // per, n))        # ... then its newest requests
    assert mine["active"] == n - 2 - len(evicted)
    survivors = [h for h in range(2, n) if h not in evicted]
    reply = a.propose([(h, per * r, [], ctx[h][0]) for h in survivors[:3] + evicted[:1]])
    assert failed(reply) == {3: "CAPACITY"} and "taken back" in reply.failures[0][2]
    assert failed(a.propose([(evicted[0], per * r, [], 1)])) == {0: "CAPACITY"}   # until re-ingested
    # a, over its share, is never given b's room: its new request is refused, b's contexts stay
    before = b.mine()["blocks"]
    reply = a.ingest([(n + 1, 0, tokens(rng, per * r))])
    assert failed(reply) == {0: "CAPACITY"} and "pool full" in reply.failures[0][2]
    assert b.mine()["blocks"] == before and failed(b.propose([(0, per * r, [], 1)])) == {}
    # what it gave back is visible
    name_a, name_b = a.stats()["session"], b.stats()["session"]
    assert metric(server, "k3_draft_session_gave_back_total", session=name_a, kind="retained") == 2
    assert metric(server, "k3_draft_session_gave_back_total", session=name_a, kind="active") == len(evicted)
    assert wait_until(lambda: metric(server, "k3_draft_session_pool_blocks", session=name_b) == before)
    assert metric(server, "k3_draft_session_pool_share_blocks", session=name_b) == caps.pool_blocks // 2


def test_borrowed_room_is_returned(server, targets):
    a = targets()
    caps, r = a.caps, a.caps.block_size
    assert caps.fair_share and caps.share_blocks == caps.pool_blocks and caps.share_weight == 1
    rng = random.Random(7)
    n = caps.pool_blocks // 2
    ctx = {h: tokens(rng, 2 * r) for h in range(n)}
    assert failed(a.ingest([(h, 0, ctx[h]) for h in range(n)])) == {}     # a alone borrows it all
    assert a.stats()["pool_free_blocks"] == 0
    b = targets()
    assert b.caps.share_blocks == caps.pool_blocks // 2                    # hello: b's guarantee now
    assert failed(b.ingest([(0, 0, tokens(rng, caps.pool_blocks // 2 * r))])) == {}
    taken = [h for h in range(n) if failed(a.propose([(h, 2 * r, [], 1)]))]
    assert len(taken) == n // 2 and taken == list(range(n - n // 2, n))   # a's newest half
    b.close()                                                              # b leaves: its room is free
    assert a.stats()["pool_free_blocks"] == caps.pool_blocks // 2
    assert failed(a.ingest([(h, 0, ctx[h]) for h in taken])) == {}        # a re-ingests and has it all
    assert a.mine()["blocks"] == caps.pool_blocks and a.stats()["pool_free_blocks"] == 0
    assert failed(a.propose([(h, 2 * r, [], 1) for h in range(n)])) == {}


def test_an_operators_weight_reaches_hello():
    s = ServerProcess("--engine", "ngram", "--session-weight", "wire=3", "--session-weight", "other=1",
                      "--lease-s", "0")
    try:
        w = Wire(s.address)                     # the bare wire client says hello as "wire"
        assert w.caps.share_weight == 3 and w.caps.share_blocks == w.caps.pool_blocks
        w.close()
    finally:
        assert s.stop() == 0
