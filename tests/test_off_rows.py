"""While speculation is off, a V1 target's step rows wait on the host and go to the server together.

The rule a user relies on: holding rows never changes what the server knows when it next drafts
(every request's rows, in order, before its next propose, free or flush), and it sends far fewer
messages while speculation is off. Unit tests of the merge on random batches, then the real
pipeline (controller, client, ``k3-draft-server --engine ngram``) against the n-gram oracle.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers.server import ServerProcess
from helpers.steps import settings, step
from helpers.v2_sim import expected
from k3_accel.vllm.spec_decode.off_rows import OffRows

W = 6


def _random_steps(rng: random.Random, n: int, with_hidden: bool):
    """``n`` ingest steps of requests joining (a prefill chunk), decoding (one row) and leaving, the
    rows each request shipped per step, and its anchor after each step."""
    pos: dict[str, int] = {}
    rows: dict[str, list[tuple[int, int, list[float] | None]]] = {}
    steps, anchors, prompts, accepted = [], {}, {}, {}
    seq = 0
    for s in range(n):
        live = [r for r in pos if rng.random() > 0.1]                      # some leave the batch
        while len(live) < 4 or rng.random() < 0.3:                        # some join
            seq += 1
            rid = f"q{seq}"
            pos[rid] = 0
            live.append(rid)
            prompts[rid] = [rng.randrange(1000) for _ in range(rng.randrange(3, 9))]
        rng.shuffle(live)
        chunks = []
        for rid in live:
            c = len(prompts[rid]) if pos[rid] == 0 else rng.choice([0, 1, 1, 2])
            chunks.append((pos[rid], [rng.randrange(1000) for _ in range(c)]))
            pos[rid] += c
        acc = [rng.randrange(3) for _ in live]
        hidden = torch.randn(sum(len(t) for _, t in chunks), W) if with_hidden else None
        inp = step(live, chunks, sampled=[True] * len(live), k=0,
                   prompts={rid: prompts[rid] for rid in live if rid not in rows}, hidden=hidden)
        inp.num_accepted = acc
        at = 0
        for rid, (start, toks), a in zip(live, chunks, acc):
            accepted[rid] = accepted.get(rid, 0) + a
            for j, t in enumerate(toks):
                rows.setdefault(rid, []).append((start + j, t, None if hidden is None else hidden[at + j].tolist()))
            if toks:
                anchors[rid] = (toks[-1] + 1, start + len(toks))
            at += len(toks)
        steps.append(inp)
    return steps, rows, anchors, prompts, accepted


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_hidden", [True, False])
def test_the_merged_ingest_carries_every_requests_rows_in_order(seed, with_hidden):
    rng = random.Random(seed)
    steps, rows, anchors, prompts, accepted = _random_steps(rng, rng.randrange(2, 12), with_hidden)
    held = OffRows(max_rows=1 << 20)
    for inp in steps:
        assert held.fits(inp)
        held.add(inp)
    merged = held.take()
    assert held.take() is None and len(held) == 0 and held.rows == 0
    merged.validate(settings("tcp://127.0.0.1:1", max_rows=1 << 20, context_width=W if with_hidden else 0,
                             hidden_dtype=torch.float32))
    shipped = [rid for rid in rows if rows[rid]]
    assert sorted(merged.req_ids) == sorted(shipped) and merged.k == 0 and not any(merged.sampled)
    at = 0
    for rid, count, tok, apos in zip(merged.req_ids, merged.counts, merged.anchor_tokens, merged.anchor_positions):
        want = rows[rid]
        assert count == len(want)
        assert merged.positions[at:at + count].tolist() == [p for p, _, _ in want]
        assert merged.token_ids[at:at + count].tolist() == [t for _, t, _ in want]
        if with_hidden:
            assert torch.equal(merged.hidden[at:at + count], torch.tensor([h for _, _, h in want]))
        assert (tok, apos) == anchors[rid]
        at += count
    assert merged.hidden is None if not with_hidden else merged.hidden.shape == (at, W)
    assert merged.prompt_token_ids == {rid: prompts[rid] for rid in merged.req_ids}
    assert merged.num_accepted == [accepted[rid] for rid in merged.req_ids]


@pytest.mark.parametrize("seed", range(6))
def test_a_dropped_request_leaves_nothing_and_the_others_keep_every_row_in_order(seed):
    """Some requests finished (or were aborted): their held rows go, the rest merge as if
    the dropped ones had never been held, and later steps of the others still fit."""
    rng = random.Random(100 + seed)
    steps, rows, anchors, prompts, _ = _random_steps(rng, rng.randrange(3, 12), True)
    held = OffRows(max_rows=1 << 20)
    for inp in steps:
        held.add(inp)
    shipped = [rid for rid in rows if rows[rid]]
    gone = rng.sample(shipped, rng.randrange(1, len(shipped) + 1)) + ["never-held"]
    total = held.rows
    assert held.drop(gone) == sum(len(rows[rid]) for rid in gone if rid in rows)
    assert held.rows == total - held.stats()["dropped_rows"]
    assert held.drop(gone) == 0                                   # nothing of theirs is left
    stay = [rid for rid in shipped if rid not in gone]
    if stay:                                                      # a later step of a staying request fits
        rid = stay[0]
        nxt = step([rid], [(anchors[rid][1], [1])], k=0, hidden=torch.zeros(1, W))
        assert held.fits(nxt)
    merged = held.take()
    if not stay:
        assert merged is None and held.rows == 0
        return
    assert sorted(merged.req_ids) == sorted(stay) and held.rows == 0
    at = 0
    for rid, count, tok, apos in zip(merged.req_ids, merged.counts, merged.anchor_tokens, merged.anchor_positions):
        want = rows[rid]
        assert count == len(want) and (tok, apos) == anchors[rid]
        assert merged.positions[at:at + count].tolist() == [p for p, _, _ in want]
        assert merged.token_ids[at:at + count].tolist() == [t for _, t, _ in want]
        assert torch.equal(merged.hidden[at:at + count], torch.tensor([h for _, _, h in want]))
        at += count
    assert merged.prompt_token_ids == {rid: prompts[rid] for rid in merged.req_ids}


def test_the_byte_bound_counts_only_the_rows_still_held_after_a_drop():
    """Holding stops at ``max_bytes`` of what is held now: the rows of a finished request no longer
    count (else every request's end would shrink the room for the others' off steps, and ship them
    early), and the count matches the bytes that would be shipped."""
    per_step = _nbytes_of(step(["a"], [(0, [1])], k=0, hidden=torch.zeros(1, W)))
    held = OffRows(max_rows=1 << 20, max_bytes=per_step * 10 + per_step // 2)
    for i in range(5):                                   # two requests, one row each per step
        inp = step(["a", "b"], [(i, [i]), (i, [i])], k=0, hidden=torch.full((2, W), float(i)))
        assert held.fits(inp)
        held.add(inp)
    nxt = step(["b"], [(5, [5])], k=0, hidden=torch.zeros(1, W))
    full = step(["a", "b"], [(5, [5]), (5, [5])], k=0, hidden=torch.zeros(2, W))
    assert not held.fits(full) and held.bytes == 10 * per_step
    assert held.drop(["a"]) == 5
    assert held.bytes == 5 * per_step and held.fits(nxt)
    for i in range(5, 10):                               # b alone may now hold as many rows again
        inp = step(["b"], [(i, [i])], k=0, hidden=torch.zeros(1, W))
        assert held.fits(inp)
        held.add(inp)
    merged = held.take()
    assert merged.req_ids == ["b"] and merged.positions.tolist() == list(range(10))
    assert _nbytes_of(merged) == 10 * per_step


def _nbytes_of(inp) -> int:
    return sum(t.numel() * t.element_size() for t in (inp.positions, inp.token_ids, inp.hidden) if t is not None)


def test_held_rows_are_copies_not_the_runners_buffers():
    held = OffRows(max_rows=64)
    inp = step(["a"], [(0, [5, 6, 7])], k=0, hidden=torch.ones(3, W))
    held.add(inp)
    inp.token_ids.fill_(0)
    inp.hidden.fill_(0)                     # the runner reuses its buffers for the next step
    merged = held.take()
    assert merged.token_ids.tolist() == [5, 6, 7] and bool((merged.hidden == 1).all())


def test_what_cannot_be_held():
    held = OffRows(max_rows=8, max_bytes=10_000)
    held.add(step(["a", "b"], [(0, [1, 2, 3]), (0, [4])], k=0))
    assert not held.fits(step(["a"], [(2, [9])], k=0)), "a rewind of a held request ships what is held first"
    assert not held.fits(step(["a"], [(4, [9])], k=0)), "a gap too"
    assert held.fits(step(["a", "c"], [(3, [9]), (0, [7])], k=0))
    assert not held.fits(step(["a"], [(3, [9])], k=2)), "a step that drafts"
    assert not held.fits(step(["c"], [(0, list(range(5)))], k=0)), "more than max_rows"
    assert not held.fits(step(["c"], [(0, [1])], k=0, hidden=torch.zeros(1, W))), "hidden rows where none were"
    meta = step(["c"], [(0, [1])], k=0)
    meta.positions = torch.empty(1, dtype=torch.int64, device="meta")
    assert not held.fits(meta), "rows off the host stay where they are"
    big = OffRows(max_rows=1 << 20, max_bytes=1000)
    assert not big.fits(step(["c"], [(0, list(range(100)))], k=0)), "more than max_bytes"


# ----------------------------------------------------------------- the real pipeline
K = 4


class Target:
    """Decode steps of ``n`` requests over a six-token alphabet (the n-gram lookup finds matches, and
    what it finds depends on every row the server holds); the simulated clock runs 10 ms a step."""

    def __init__(self, pipe, n: int, rng: random.Random):
        self.pipe, self.now = pipe, 0.0
        pipe.controller.clock = lambda: self.now
        self.ids = [f"r{i}" for i in range(n)]
        self.hist = {rid: [] for rid in self.ids}
        self.prompt = {rid: [rng.randrange(10, 16) for _ in range(12)] for rid in self.ids}
        self.anchor = {rid: rng.randrange(10, 16) for rid in self.ids}
        self.rng = rng
        self.returned: list[bool] = []          # per step: whether the step thread waited for the draft thread

    def step(self):
        chunks, prompts = [], {}
        for rid in self.ids:
            if not self.hist[rid]:
                chunks.append((0, self.prompt[rid]))
                prompts[rid] = self.prompt[rid]
            else:
                chunks.append((len(self.hist[rid]), [self.anchor[rid]]))
        anchors = [self.rng.randrange(10, 16) for _ in self.ids]
        inp = step(self.ids, chunks, anchors=anchors, k=K, prompts=prompts or None)
        for rid, (_, toks), a in zip(self.ids, chunks, anchors):
            self.hist[rid] += toks
            self.anchor[rid] = a
        self.now += 0.010
        out = self.pipe.step_v1(inp, timeout=60)          # what RemoteDraftSession.step calls (V1)
        self.now += 0.002
        self.returned.append(out is not None)
        inp.positions.fill_(-7)                          # the runner reuses its buffers from here on
        inp.token_ids.fill_(-7)
        return torch.full((len(self.ids), K), -1, dtype=torch.int64) if out is None else out.drafts


def _off_pipeline(server, failures: list[str] | None = None, probe_interval: int = 1000, probe_steps: int = 2):
    """The real pipeline and client against ``server``, with a controller that starts off (a useless
    prior) and probes every ``probe_interval`` steps; failures are appended to ``failures``."""
    from k3_accel.transport.client import DraftClient
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings
    from k3_accel.vllm.spec_decode.fence import HostFence
    from k3_accel.vllm.spec_decode.pipeline import DraftPipeline
    sink = failures if failures is not None else []
    return DraftPipeline(DraftClient(settings(server.address, num_speculative_tokens=K)), HostFence(), 8, K,
                         lambda kind, what: sink.append(what),
                         controller=Controller(ControllerSettings(k_max=K, probe_interval=probe_interval,
                                                                  probe_steps=probe_steps, prior=0.0,
                                                                  prior_weight=100.0)))


@pytest.fixture
def off_pipe():
    """``(pipeline, failures)`` against a fresh n-gram server, speculation off from the start and no
    probe due for 1000 steps; closed and stopped afterwards."""
    server = ServerProcess("--engine", "ngram")
    failures: list[str] = []
    pipe = _off_pipeline(server, failures)
    yield pipe, failures
    pipe.close(10)
    server.stop()


def test_held_rows_reach_the_server_before_its_next_draft():
    server = ServerProcess("--engine", "ngram")
    failures: list[str] = []
    # a draft known to be useless (prior 0): off from the start, a probe now and then
    pipe = _off_pipeline(server, failures, probe_interval=12, probe_steps=1)
    try:
        target = Target(pipe, 3, random.Random(7))
        probes = 0
        for n in range(70):
            drafts = target.step()
            ctl = pipe.call(lambda c: pipe.controller.snapshot(), timeout=60)   # on the thread that owns it
            if (drafts >= 0).any():                     # a probe: the server had every held row
                probes += n > 3
                for i, rid in enumerate(target.ids):
                    # drafts reach vLLM for the anchor just sampled: history = every row shipped
                    # (the controller may hand out fewer than K: the rest read -1)
                    g = int((drafts[i] >= 0).sum())
                    want = expected(target.hist[rid], target.anchor[rid], K)
                    assert drafts[i].tolist() == want[:g] + [-1] * (K - g), (n, rid)
        client = pipe.call(lambda c: c.stats(), timeout=60)      # after every step handed over
        held = pipe.off_rows.stats()
        assert probes >= 2 and ctl["off_steps"] >= 25
        assert held["held_steps"] >= 20, held
        sent = client["counters"].get("ingest_messages", 0)
        assert sent * 4 <= held["held_steps"], (sent, held)        # one message for many off steps
        assert not failures
    finally:
        pipe.close(10)
        server.stop()


def test_a_free_forgets_the_freed_requests_held_rows_and_a_flush_sends_the_others():
    """A request vLLM dropped never drafts again under its id: its held rows are not shipped (its end
    used to cost the server an ingest of every row held, for every request), nothing of it reaches
    the server after its free, and the requests still running keep every row, in order."""
    server = ServerProcess("--engine", "ngram")
    pipe = _off_pipeline(server)
    try:
        target = Target(pipe, 2, random.Random(3))
        for _ in range(12):
            target.step()
        pipe.call(lambda c: None, timeout=60)                     # the draft thread has run every step
        assert len(pipe.off_rows) > 0
        held_r0 = len(target.hist["r0"])
        assert held_r0 > len(target.prompt["r0"])                # r0 had held decode rows to lose
        def stored():              # rows the server has stored, once everything sent has arrived
            pipe.call(lambda c: c.flush(), timeout=60)
            return pipe.call(lambda c: c.server_stats(), timeout=60)["ingested_rows"]
        before = stored()
        pipe.finish(["r0"])                                      # what RemoteDraftSession.finish calls
        target.ids.remove("r0")                                  # vLLM dropped it
        assert stored() == before                                # the free shipped no rows
        client = pipe.call(lambda c: c.stats(), timeout=60)
        held = pipe.off_rows.stats()
        assert held["dropped_rows"] > 0 and held["rows_now"] > 0         # r0's went, r1's wait
        # nothing of r0 was shipped after its free (that would be a request the client no longer
        # knows, blamed as a cold start)
        assert client["requests"]["disabled"] == 0 and not client["counters"].get("failures"), client
        pipe.flush(60)                                                          # what RemoteDraftSession.flush calls
        assert len(pipe.off_rows) == 0
        # r1 keeps its context: a draft for it now sees every row it shipped, held ones included
        hist, anchor = target.hist["r1"], target.anchor["r1"]
        ask = step(["r1"], [(len(hist), [])], anchors=[anchor], k=K)
        assert pipe.call(lambda c: c.step(ask), timeout=60).drafts[0].tolist() == expected(hist, anchor, K)

        for _ in range(6):
            target.step()
        pipe.call(lambda c: None, timeout=60)                     # the draft thread has run every step
        assert len(pipe.off_rows) > 0
        pipe.flush(60)
        assert len(pipe.off_rows) == 0
        hist, anchor = target.hist["r1"], target.anchor["r1"]
        ask = step(["r1"], [(len(hist), [])], anchors=[anchor], k=K)
        assert pipe.call(lambda c: c.step(ask), timeout=60).drafts[0].tolist() == expected(hist, anchor, K)
    finally:
        pipe.close(10)
        server.stop()


def test_an_off_step_hands_its_rows_over_without_waiting(off_pipe):
    """While speculation stays off, a V1 step returns at once (no drafts) even with the draft thread
    busy; its rows were copied before it returned (the runner overwrites them), and the server
    still ends up with every row in order."""
    import threading

    pipe, failures = off_pipe
    target = Target(pipe, 3, random.Random(11))
    for _ in range(4):
        target.step()
    assert pipe.controller.stays_off()
    busy = threading.Event()
    pipe.call(lambda c: busy.wait(60), wait=False)          # the draft thread is busy elsewhere
    for _ in range(6):
        target.step()
    assert target.returned[-6:] == [False] * 6             # none of them waited for it
    busy.set()
    pipe.flush(60)
    assert pipe.controller.counters["held_steps"] >= 6
    for rid in target.ids:                                  # every row, none of the scribbled copies
        hist, anchor = target.hist[rid], target.anchor[rid]
        ask = step([rid], [(len(hist), [])], anchors=[anchor], k=K)
        assert pipe.call(lambda c: c.step(ask), timeout=60).drafts[0].tolist() == expected(hist, anchor, K), rid
    assert not failures


def test_off_steps_are_waited_for_again_once_drafting_would_pay(off_pipe):
    """Handing off steps over unwaited rests on knowing the controller's choice ahead. Once the
    draft thread finds that drafting would pay again (here: an acceptance estimate that now says so,
    with no probe due for hundreds of steps), the very next step the step thread runs after it waits
    for the draft thread and drafts: not the rest of an off stretch counted before."""
    import numpy as np

    pipe, failures = off_pipe
    target = Target(pipe, 3, random.Random(5))
    for _ in range(6):
        target.step()
        pipe.call(lambda c: None, timeout=60)               # the draft thread idle between steps
    assert target.returned[-3:] == [False] * 3              # off, handed over unwaited
    assert pipe.controller.off_budget() > 100               # no probe due for a long while
    tried = np.full(K, 1000.0)
    pipe.call(lambda c: pipe.controller.acceptance.restart(tried, tried), timeout=60)   # every draft accepted
    target.step()                                           # the draft thread finds it would pay ...
    pipe.call(lambda c: None, timeout=60)
    drafts = target.step()                                  # ... so this step waits, and drafts
    assert target.returned[-1] is True
    assert (drafts >= 0).any()
    assert not failures
