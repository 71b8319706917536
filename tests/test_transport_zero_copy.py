"""Staging-slot lifetime under zero-copy sends, and back-pressure, through a pausable relay.

The relay sits between the client and a real draft server. While paused it
reads nothing, so the client's multi-megabyte zero-copy frames stay queued
inside libzmq, still pointing at slot memory. Every frame the relay later
forwards is hashed: if a slot were rewritten before its reply, the server
would receive another step's bytes and the hashes would not match.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers.relay import Relay, digest
from helpers.steps import drafts_again, wait_until
from k3_accel.transport.staging import StagingRing

ROWS = 1 << 18          # 256 Ki rows: 2 MiB of token ids per step (far beyond the socket buffers)


def chunk(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of step ``step`` for one request: contiguous positions, step-specific tokens."""
    positions = torch.arange(step * ROWS, (step + 1) * ROWS, dtype=torch.int64)
    gen = torch.Generator().manual_seed(step)
    return positions, torch.randint(0, 50_000, (ROWS,), generator=gen, dtype=torch.int64)


def ingest_step(positions: torch.Tensor, tokens: torch.Tensor):
    from k3_accel.transport.api import StepInput
    start = int(positions[0])
    return StepInput(["a"], [ROWS], positions, tokens, [False], [0], [start + ROWS], k=4)


@pytest.fixture
def relay(server):
    r = Relay(server.address)
    yield r
    r.resume()
    r.close()


def forwarded_ingests(relay: Relay) -> list[str]:
    """The token frame's digest of every forwarded ingest (frames: meta, tokens)."""
    return [d[1] for d in relay.ops("ingest")]


def test_slot_is_not_rewritten_before_its_reply_and_ring_applies_back_pressure(relay, client_factory):
    client = client_factory(relay.address, ring_depth=2, max_rows=ROWS, timeout_ms=20000)
    steps = [chunk(s) for s in range(4)]
    relay.pause()
    assert client.step(ingest_step(*steps[0])).deferred
    assert client.step(ingest_step(*steps[1])).deferred
    done = threading.Event()
    worker = threading.Thread(target=lambda: (client.step(ingest_step(*steps[2])), done.set()))
    worker.start()
    # both slots are referenced by unanswered messages: the third step must wait for a slot
    # (a slow machine only makes it wait longer; the timeout is 20 s)
    time.sleep(0.5)
    assert not done.is_set() and worker.is_alive()
    relay.resume()
    worker.join(30)
    assert done.is_set()
    client.step(ingest_step(*steps[3]))
    client.flush()
    got = forwarded_ingests(relay)
    want = [digest(tok) for _, tok in steps]
    assert got == want                                  # every server-side byte is its own step's
    counters = client.stats()["counters"]
    assert counters["ring_waits"] >= 1 and counters["deferred_ingests"] == 4
    assert not any(k.startswith("failures.") for k in counters)
    assert client.server_stats()["ingested_rows"] == 4 * ROWS


def test_relay_detects_a_slot_reused_too_early(relay, client_factory, monkeypatch):
    """The check above has teeth: a ring that ignores holds corrupts what the server gets."""
    from k3_accel.transport.sender import SendJob
    client = client_factory(relay.address, ring_depth=1, max_rows=ROWS, timeout_ms=20000)
    monkeypatch.setattr(StagingRing, "busy", lambda self, slot: False)
    steps = [chunk(s) for s in range(3)]
    gate = threading.Event()
    # the sender is held until every step has rewritten the only slot (whether the wire or the kernel's
    # socket buffers took the first frames in time depended on the load: the check must not)
    client.sender.submit(SendJob(build=lambda: gate.wait(60)))
    relay.pause()
    try:
        for s in steps:                                 # each step rewrites the only slot at once
            client.step(ingest_step(*s))
    finally:
        gate.set()
        relay.resume()
    assert wait_until(lambda: len(forwarded_ingests(relay)) == 3)
    assert forwarded_ingests(relay) != [digest(tok) for _, tok in steps]


def test_ring_wait_gives_up_at_the_timeout_and_fails_closed(relay, client_factory):
    client = client_factory(relay.address, ring_depth=1, max_rows=ROWS, timeout_ms=2000)
    steps = [chunk(s) for s in range(2)]
    relay.pause()
    client.step(ingest_step(*steps[0]))
    out = client.step(ingest_step(*steps[1]))           # slot busy; no reply comes in time
    assert client.is_disabled("a")
    assert out.drafts.tolist() == [[-1] * 4]
    counters = client.stats()["counters"]
    # the ring's deadline or the message's, whichever comes first: either way the batch fails closed
    assert counters.get("failures.transport", 0) + counters.get("failures.ring_timeout", 0) >= 1
    assert counters["disabled_requests"] == 1
    relay.resume()
    # the connection was rebuilt; a new request drafts again (slot freed once libzmq let go)
    assert drafts_again(client)
