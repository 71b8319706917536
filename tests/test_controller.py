"""The per-step K controller on synthetic and recorded traces (no vLLM, no server).

A fake target: each step takes ``fixed + per_token * tokens`` seconds (fed as the
controller's clock), the draft round trip ``rt`` seconds, and request ``i``
accepts its drafts by a per-position schedule. The controller sees only what the
pipeline gives it: each step's StepInput (valid rows = 1 + accepted drafts) and
the client's drafts.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from k3_accel.transport.api import StepInput, StepOutput
from k3_accel.vllm.spec_decode.controller import TRACE_STEPS, Controller, ControllerSettings

K = 7


class FakeTarget:
    """Drives a controller like the draft thread does, with a simulated clock."""

    def __init__(self, controller: Controller, batch: int, fixed=0.010, per_token=0.0001, rt=0.002):
        self.c, self.batch = controller, batch
        self.fixed, self.per_token, self.rt = fixed, per_token, rt
        self.now = 0.0
        controller.clock = lambda: self.now
        self.ids = [f"r{i}" for i in range(batch)]
        self.given = {r: 0 for r in self.ids}
        self.asked: list[np.ndarray] = []
        self.accept = lambda step, i, j: False          # draft j (0-based) of request i accepted?
        self.stall = lambda step: 0.0                    # extra seconds of a step (a JIT compile, a GC pause)
        self.prefill = lambda step: 0                    # rows of a request mid-prefill in this step
        self.confidence = None                           # the server's per-draft confidence, (step, i, j) -> p
        self.hiccup = lambda step: 0.0                   # extra seconds of a round trip (a server pause)
        self.draft_overhead = 0.0                        # extra seconds of a forward that verifies drafts
        # vLLM's adaptive verification: a step verifies at most as many drafts as the step *before*
        # the drafts' own step had (its budget reads the confidences one step late); the runner
        # then reports what it verified (StepInput.num_verified)
        self.stale_budget = False
        # V2's step thread: a step launched while Controller.stays_off() said so (read ``hold_lag`` steps
        # before the draft thread gets to it) goes as an ingest, held; None: no step is held
        self.hold_lag: int | None = None
        self._holds: list[bool] = []
        # V2's draft thread: the GPU goes on once the controller says a step drafts nothing
        # (``decided``), and while speculation is on the controller chooses while the reply travels
        self.v2 = False
        self.sent: list[int] = []                        # the K each step asked the server for
        self._proposing = True

    def step(self, n: int) -> list[np.ndarray]:
        """``n`` decode steps; returns the drafts per request handed to vLLM each step."""
        out = []
        for s in range(n):
            counts, tokens, verified = [], 0, []
            budget = int(self.asked[-2].sum()) if len(self.asked) >= 2 else 0
            for i, rid in enumerate(self.ids):
                g = self.given[rid]
                if self.stale_budget:
                    g = min(g, budget)
                    budget -= g
                verified.append(g)
                acc = 0
                while acc < g and self.accept(len(self.asked), i, acc):
                    acc += 1
                counts.append(1 + acc)
                tokens += 1 + g
            pre = self.prefill(len(self.asked))
            tokens += pre
            self.now += self.fixed + self.per_token * tokens + self.stall(len(self.asked)) \
                + self.draft_overhead * (sum(verified) > 0)                                 # this step's forward
            ids, counts, sampled = self.ids + ["prefill"] * (pre > 0), counts + [pre] * (pre > 0), \
                [True] * self.batch + [False] * (pre > 0)
            inp = StepInput(ids, counts, torch.zeros(sum(counts), dtype=torch.int64),
                            torch.zeros(sum(counts), dtype=torch.int64), sampled,
                            [0] * len(ids), [1] * len(ids), k=K,
                            num_verified=verified + [0] * (pre > 0) if self.stale_budget else None)
            held = False
            if self.hold_lag is not None:
                self._holds.append(self.c.stays_off())
                held = self._holds[-1 - self.hold_lag] if len(self._holds) > self.hold_lag else False
                if held:
                    inp = dataclasses.replace(inp, k=0)
            if self.v2:
                res = self.c.step(inp, self._server, decided=self._decided, held=held)
            else:
                res = self.c.step(inp, self._server, held=held)
            got = (res.drafts[:self.batch] >= 0).sum(dim=1).numpy()
            self.asked.append(got)
            self.given = dict(zip(self.ids, got.tolist()))
            out.append(got)
        return out

    def _decided(self, proposing: bool) -> None:
        self._proposing = proposing

    def _server(self, inp: StepInput, while_waiting=None) -> StepOutput:
        self.sent.append(inp.k)
        if while_waiting is not None and inp.k > 0:
            while_waiting()                                    # the propose is out: the choice is made
        if inp.k > 0 and (self._proposing or not self.v2):    # V2: a step drafting nothing waits for no reply
            self.now += self.rt + self.hiccup(len(self.asked))
        out = StepOutput(torch.full((len(inp.req_ids), inp.k), 5, dtype=torch.int64))
        if self.confidence is not None and inp.k > 0:
            out.extra["confidence"] = torch.tensor([[self.confidence(len(self.asked), i, j) for j in range(inp.k)]
                                                    for i in range(len(inp.req_ids))], dtype=torch.float32)
        return out


def test_controller_turns_off_when_acceptance_collapses():
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=16)), batch=8)
    t.accept = lambda step, i, j: step < 40                 # a good draft, then nothing is accepted
    early = t.step(40)
    assert np.mean([d.mean() for d in early[10:]]) > 3       # drafting while it pays
    late = t.step(160)[40:]                                  # after it has seen the collapse
    off = sum(1 for d in late if d.sum() == 0)
    assert off >= len(late) * 0.8                            # most steps ask for no drafts at all
    assert t.c.counters["probe_steps"] >= 1                  # but it keeps probing, at a bounded rate
    assert t.c.counters["probe_steps"] <= (len(late) / 16 + 2) * t.c.s.probe_steps


def test_controller_probes_and_turns_back_on():
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8)), batch=4)
    t.accept = lambda step, i, j: step >= 60                 # useless first, then a perfect draft
    t.step(60)
    assert sum(d.sum() for d in t.asked[30:60]) <= 4 * K * 5 * t.c.s.probe_steps  # off apart from a few probes
    back = t.step(80)[40:]
    assert all(d.sum() > 0 for d in back)                    # noticed, and drafting again
    assert np.mean([d.mean() for d in back]) > K / 2


def test_a_probe_counts_only_what_vllm_verified():
    """Under vLLM's adaptive verification a step verifies no more drafts than the step before it
    had (the budget reads confidences a step late): after an off stretch the first step's drafts are
    not verified at all. Those are no rejections, and a probe lasts long enough to be verified, so a
    draft that starts paying turns speculation back on (on the H200 it stayed off for good: acceptance
    0 in every run of the adaptive variant)."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8)), batch=4)
    t.stale_budget = True
    t.accept = lambda step, i, j: step >= 60                 # useless first, then a perfect draft
    t.step(60)
    assert sum(d.sum() for d in t.asked[30:60]) <= 4 * K * 5 * t.c.s.probe_steps  # off apart from the probes
    back = t.step(80)[40:]
    assert all(d.sum() > 0 for d in back)                    # noticed, and drafting again
    assert np.mean([d.mean() for d in back]) > K / 2
    assert t.c.acceptance.global_rate()[0] > 0.9             # what was verified was accepted


def test_drafts_vllm_did_not_verify_are_no_rejections():
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8)), batch=4)
    t.stale_budget = True
    t.accept = lambda step, i, j: True                       # a perfect draft; the first step's drafts
    rates = []                                               # are not verified (no budget yet)
    for _ in range(12):
        t.step(1)
        rates.append(t.c.acceptance.global_rate()[0])
    assert min(rates) >= t.c.s.prior                         # never learnt as rejected
    calibration = t.c.counters["calibration_steps"]          # plain steps that measure a plain forward
    assert calibration <= t.c.cost.min_steps
    assert sum(1 for d in t.asked if d.sum() > 0) == len(t.asked) - calibration


def test_controller_never_exceeds_configured_k():
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=4)), batch=16, per_token=0.0)
    t.accept = lambda step, i, j: (step + i + j) % 3 != 0
    for d in t.step(120):
        assert d.max() <= K and d.min() >= 0
    # and never more than the step asks for (the scheduler's K for this step)
    c = Controller(ControllerSettings(k_max=K))
    inp = StepInput(["a"], [1], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), [True],
                    [0], [1], k=2)
    out = c.step(inp, lambda i: StepOutput(torch.full((1, i.k), 3, dtype=torch.int64)))
    assert tuple(out.drafts.shape) == (1, 2)


def test_min_k_keeps_speculation_on():
    t = FakeTarget(Controller(ControllerSettings(k_max=K, k_min=2)), batch=4)
    t.accept = lambda step, i, j: False
    assert all(d.min() >= 2 for d in t.step(60))


@pytest.mark.parametrize("stalled", [(3,), (2, 5, 9)])
def test_warm_up_stalls_do_not_turn_a_paying_draft_off(stalled):
    """A GPU engine's first steps stall on kernel compiles (seconds, on vLLM's own JIT), some of
    them steps with a long prompt's chunk: those periods say nothing about what a token costs,
    and a draft that pays keeps drafting."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=32)), batch=16,
                   fixed=0.004, per_token=0.00001)
    t.accept = lambda step, i, j: j < 4                       # four of seven drafts accepted, always
    t.stall = lambda step: 1.5 if step in stalled else 0.0
    t.prefill = lambda step: 128 if step < 10 and step % 2 == 0 else 0
    after = t.step(60)[12:]
    assert sum(1 for d in after if d.sum() == 0) == 0         # never off
    assert np.mean([d.mean() for d in after]) >= 4            # and drafting what is accepted


def test_one_slow_round_trip_does_not_hold_speculation_off():
    """A server hiccup (a first-use compile, a GC pause: one reply seconds late) is not what the draft
    costs: a draft that pays keeps drafting right after it. (An average of the waits let one such reply
    hold speculation off for hundreds of steps in the H200 run, where probes are the only proposes.)"""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=32)), batch=8)
    t.accept = lambda step, i, j: j < 4                      # a good draft throughout
    t.hiccup = lambda step: 5.0 if step == 20 else 0.0
    assert all(d.sum() > 0 for d in t.step(20)[9:])          # past the first plain steps (calibration)
    after = t.step(40)[2:]
    assert all(d.sum() > 0 for d in after)
    assert t.c.cost.round_trip < 0.1


def test_server_confidence_trims_the_drafts_it_doubts():
    """DSpark's confidence head says, per draft of this step, how likely it is to be accepted:
    the drafts it doubts are not handed to vLLM, those it trusts are, whatever the history says."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=32)), batch=8)
    t.accept = lambda step, i, j: j < 2 + (i % 2) * 3            # requests accept 2 or 5 drafts
    t.confidence = lambda step, i, j: 0.97 if j < 2 + (i % 2) * 3 else 0.02
    got = t.step(40)[10:]
    assert all((d[0::2] <= 3).all() for d in got)                # the doubted tail is cut (at most one over)
    assert np.mean([d[1::2].mean() for d in got]) >= 4           # the trusted drafts still go
    assert t.c.counters["hint_trimmed_drafts"] > 0


def test_a_draft_the_server_doubts_throughout_turns_speculation_off():
    """A draft that paid and then stops (a new domain), with a server whose confidence head says so
    for every draft: the hint trims them all, so none reaches vLLM and none is verified. What it
    said must still count, or the history that paid keeps every step a propose whose round trip is
    paid for nothing (on the H200's shape 60 % slower than no speculation): speculation goes off,
    apart from probes at the probe rate."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=16)), batch=8,
                   fixed=0.0053, per_token=0.00004, rt=0.0032)
    t.accept = lambda step, i, j: step < 50 and j < 4
    t.confidence = lambda step, i, j: (0.95 if j < 4 else 0.05) if step < 50 else 0.01
    t.step(50)
    assert sum(1 for k in t.sent[10:] if k > 0) >= 30                  # it paid: drafting
    t.step(250)
    late = t.sent[100:]
    assert sum(1 for k in late if k > 0) <= (len(late) / 16 + 2) * t.c.s.probe_steps
    assert t.c.counters["off_steps"] >= 150


def test_a_request_the_server_drafts_nothing_for_is_no_evidence_from_its_confidence():
    """The client's confidence for a request it did not propose for (disabled after a failure) is 0,
    with no draft: nothing the server doubted. It must not count as a rejection of the draft the
    other requests are getting accepted."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=32)), batch=4)
    t.accept = lambda step, i, j: i > 0
    t.confidence = lambda step, i, j: 0.0 if i == 0 else 0.97
    server = t._server

    def disabled_first(inp, while_waiting=None):
        out = server(inp, while_waiting)
        if inp.k > 0:
            out.drafts[0] = -1
        return out
    t._server = disabled_first
    t.step(40)
    assert t.c.acceptance.global_rate()[0] > 0.9


def test_no_confidence_means_no_trimming_by_it():
    def run(conf):
        t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=32)), batch=4)
        t.accept = lambda step, i, j: j < 4
        t.confidence = conf
        return [d.tolist() for d in t.step(30)], t.c.counters["hint_trimmed_drafts"]
    plain, trimmed = run(None)
    none_sent, trimmed_none = run(lambda step, i, j: -1.0)       # a server without a confidence head
    assert plain == none_sent and trimmed == trimmed_none == 0


def test_without_server_confidence_the_controller_reports_its_acceptance_estimate():
    """vLLM's adaptive verification ranks a step's draft slots by the running product of their
    confidence and sizes the next budget from it: the controller hands it what it measured (each
    request's acceptance per position, its first drafts above the ones it sees rejected), -1 where it
    gave no draft, a server's own value where one came; a probe carries none (it must be verified)."""
    c = Controller(ControllerSettings(k_max=K, probe_interval=1000, confidence=True))
    t = FakeTarget(c, batch=4)
    t.accept = lambda step, i, j: j < 3                          # three drafts accepted, never a fourth
    t.step(30)
    inp = StepInput(t.ids, [4] * 4, torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64),
                    [True, True, True, False], [0] * 4, [1] * 4, k=K)
    seen = {}

    def server(step_input, theirs=None):
        out = StepOutput(torch.full((4, step_input.k), 5, dtype=torch.int64))
        if theirs is not None:
            out.extra["confidence"] = theirs
        seen["out"] = out
        return out
    out = c.step(inp, server)
    conf, given = out.extra["confidence"], out.drafts >= 0
    assert conf.shape == (4, K) and conf.dtype == torch.float32
    assert ((conf == -1) == ~given).all() and not given[3].any()   # none where no draft (request 3 samples not)
    rates = torch.from_numpy(c.acceptance.rates(t.ids)).float()
    assert torch.equal(conf[given], rates[:, :K][given])
    assert (conf[:3, :3] > 0.8).all() and (conf[:3, 3][given[:3, 3]] < 0.5).all()
    theirs = torch.full((4, K), -1.0)
    theirs[0, 0] = 0.125                                           # a server's own value wins where sent
    out = c.step(inp, lambda i: server(i, theirs))
    assert out.extra["confidence"][0, 0] == 0.125 and out.extra["confidence"][1, 0] > 0.8
    useless = Controller(ControllerSettings(k_max=K, probe_interval=4, confidence=True))
    t = FakeTarget(useless, batch=2)                               # nothing accepted: off, with probes
    outs, step = [], useless.step
    useless.step = lambda *a, **kw: outs.append((step(*a, **kw), useless._probing)) or outs[-1][0]
    t.step(60)
    drafted = [(o, probing) for o, probing in outs if (o.drafts >= 0).any()]
    assert any(probing for _, probing in drafted) and any(not probing for _, probing in drafted)
    assert all(("confidence" in o.extra) != probing for o, probing in drafted)
    plain = Controller(ControllerSettings(k_max=K, probe_interval=1000))   # no adaptive verification:
    t = FakeTarget(plain, batch=4)                                         # nobody reads it, none is made
    t.accept = lambda step, i, j: j < 3
    t.step(30)
    out = plain.step(inp, server)
    assert (out.drafts >= 0).any() and "confidence" not in out.extra


def test_controller_same_on_every_tp_rank():
    """Decisions are a function of the trace alone: two controllers (two ranks, or a replay)
    fed the same inputs and times decide the same, step for step."""
    def run():
        t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8)), batch=6)
        t.accept = lambda step, i, j: (step // 20) % 2 == 0 and j < 3 + i % 3
        return [d.tolist() for d in t.step(100)]
    assert run() == run()


def test_choosing_while_the_reply_travels_changes_no_choice():
    """On V2 the controller sends a step as a propose while speculation is on and chooses while its
    reply travels (off the drafts' critical path): every step hands out exactly the drafts choosing
    first would, through a draft that stops paying and starts again (off stretches, probes). Only
    the first step of an off stretch still goes as a propose (its drafts dropped); while off, ingests."""
    def run(v2):
        t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8)), batch=6)
        t.v2 = v2
        t.accept = lambda step, i, j: (step // 40) % 2 == 0 and j < 3 + i % 3
        return [d.tolist() for d in t.step(160)], t.sent, t.c.counters
    first, sent_v1, counters = run(False)
    early, sent_v2, _ = run(True)
    assert early == first
    assert counters["off_steps"] > 40 and counters["probe_steps"] > 0         # the run went off and probed
    changed = [i for i, (a, b) in enumerate(zip(sent_v1, sent_v2)) if a != b]
    assert changed and all(sent_v1[i] == 0 and sent_v2[i] == K and sum(early[i]) == 0 for i in changed)
    assert all(sum(early[i - 1]) > 0 for i in changed)                        # the first step off: a propose
    assert sent_v2.count(0) >= 40                                             # while off: ingests


def test_a_step_chosen_to_draft_nothing_after_its_propose_left_hands_out_nothing():
    """On V2 a step goes out as a propose before the choice; when the choice is "nothing" the
    server's reply (drafts and its per-draft confidence) must not reach vLLM: no drafts, no
    confidence (adaptive verification would rank slots that hold no draft), and the GPU was told
    before the reply came."""
    c = Controller(ControllerSettings(k_max=K, probe_interval=1000, confidence=True))
    c.acceptance.tried[:], c.acceptance.accepted[:] = 1000.0, 0.0     # measured: every draft rejected
    for tokens in (8, 16, 24, 32):
        c.cost.observe(tokens, 0.010 + 0.001 * tokens)
    c.cost.observe_round_trip(0.002)
    b, events = 6, []

    def server(inp, while_waiting=None):
        events.append(("sent", inp.k))
        if while_waiting is not None:
            while_waiting()
        events.append("reply")
        out = StepOutput(torch.full((b, inp.k), 5, dtype=torch.int64))
        out.extra["confidence"] = torch.full((b, inp.k), 0.9)
        return out
    inp = StepInput([f"r{i}" for i in range(b)], [1] * b, torch.zeros(b, dtype=torch.int64),
                    torch.zeros(b, dtype=torch.int64), [True] * b, [0] * b, [1] * b, k=K)
    out = c.step(inp, server, decided=lambda proposing: events.append(("decided", proposing)))
    assert events == [("sent", K), ("decided", False), "reply"]
    assert (out.drafts == -1).all() and tuple(out.drafts.shape) == (b, K)
    assert "confidence" not in out.extra and c.given == {}


def test_an_off_batch_sends_an_ingest_not_a_propose():
    c = Controller(ControllerSettings(k_max=K, probe_interval=1000))
    t = FakeTarget(c, batch=2, rt=0.5)                        # the round trip dwarfs the step
    t.accept = lambda step, i, j: False
    seen, server = [], t._server
    t._server = lambda inp: (seen.append(inp.k), server(inp))[1]
    t.step(30)
    assert seen[-1] == 0 and seen.count(0) >= 20            # nothing asked of the server: an ingest
    assert c.snapshot()["k_chosen"]["0"] >= 40


def test_settings_are_checked():
    with pytest.raises(ValueError, match="adaptive_min_k"):
        ControllerSettings(k_max=3, k_min=4)
    with pytest.raises(ValueError, match="probe_interval"):
        dataclasses.replace(ControllerSettings(k_max=3), probe_interval=0)


def test_probes_of_a_useless_draft_back_off_but_stay_bounded():
    """A draft that never pays costs ever less: the gap between probes doubles while they find
    nothing, but never past PROBE_BACKOFF x probe_interval, so a draft that starts paying is
    still noticed within a bounded number of steps."""
    from k3_accel.vllm.spec_decode.controller import PROBE_BACKOFF
    interval = 8
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=interval)), batch=4)
    t.accept = lambda step, i, j: False
    t.step(600)
    probes = [n for n, d in enumerate(t.asked) if n > 5 and d.sum() > 0]
    bursts = [n for n in probes if n - 1 not in probes]
    gaps = np.diff(bursts)
    assert len(gaps) >= 4 and gaps[-1] > gaps[0]                     # sparser than at first ...
    assert gaps.max() <= PROBE_BACKOFF * interval + 2 * t.c.s.probe_steps + 1   # ... within the bound
    assert len(probes) < 600 / interval                               # fewer than a fixed interval's
    t.accept = lambda step, i, j: True                                # then a perfect draft
    back = t.step(PROBE_BACKOFF * interval + 20)[-8:]
    assert all(d.sum() > 0 for d in back)


@pytest.mark.parametrize("batch", [1, 8])
def test_one_probe_that_finds_a_paying_draft_turns_speculation_back_on(batch):
    """After a long useless stretch, the first verified probe that finds drafts accepted which would
    pay on their own turns speculation back on at once, however many rejections came before it
    (those describe a regime that has ended). On the H200 a run of 128 tokens at B = 1 and 8 stayed
    off at acceptance length 4 after a run at length 1: one probe per run, outweighed every time."""
    from k3_accel.vllm.spec_decode.controller import PROBE_BACKOFF
    interval = 8
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=interval)), batch=batch,
                   fixed=0.0053, per_token=0.00004, rt=0.0032)   # the H200's Qwen3-8B shape, P6
    t.stale_budget = True                                    # vLLM's adaptive verification
    t.accept = lambda step, i, j: False
    t.step(400)
    assert sum(1 for d in t.asked[-100:] if d.sum() == 0) >= 80        # off, apart from probes
    t.accept = lambda step, i, j: j < 3                      # acceptance length 4 from here on
    after = t.step(PROBE_BACKOFF * interval + 40)
    first = next(n for n, d in enumerate(after) if d.sum() > 0)          # the next probe
    assert first <= PROBE_BACKOFF * interval + 1
    rest = after[first + t.c.s.probe_steps + 1:]
    assert len(rest) >= 20 and all(d.sum() > 0 for d in rest)          # on from the verified probe on


@pytest.mark.parametrize("batch, accept", [
    (1, lambda step, i, j: False),
    (8, lambda step, i, j: False),
    (8, lambda step, i, j: j == 0 and i == 0 and step % 2 == 0),   # one request's first draft, sometimes
])
def test_a_probe_that_finds_nothing_leaves_speculation_off(batch, accept):
    """The same rule never turns a useless draft on: a probe whose accepted drafts would not pay
    on their own changes nothing but the evidence."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8)), batch=batch,
                   fixed=0.0053, per_token=0.00004, rt=0.0032)
    t.stale_budget = True
    t.accept = lambda step, i, j: False
    t.step(300)
    before = t.c.counters["probe_steps"]
    t.accept = accept
    late = t.step(300)
    probes = t.c.counters["probe_steps"] - before
    assert probes >= 4                                                 # it kept probing ...
    assert sum(1 for d in late if d.sum() > 0) == probes               # ... and drafted nowhere else
    assert t.c.counters["probe_restarts"] == 0


def test_a_lasting_change_of_step_time_is_learnt_not_rejected_as_stalls():
    """Stalls are rare by nature: when most recent periods exceed what the fit predicts, the fit is
    what is wrong (its first steps were unlike the rest: a warm-up, a switch of batch regime), and it
    learns the new step time within a window instead of rejecting every period for good."""
    c = Controller(ControllerSettings(k_max=K))
    for _ in range(8):
        c.cost.observe(32, 0.0004)                 # a fit from steps 25x shorter than the real ones
    for _ in range(c.cost.window * 2):
        c.cost.observe(32, 0.010)
    a, b = c.cost.line()
    assert a + 32 * b == pytest.approx(0.010, rel=0.05)
    assert c.cost.stalls <= c.cost.window


def test_rare_stalls_still_leave_the_fit_alone():
    c = Controller(ControllerSettings(k_max=K))
    for n in range(200):
        c.cost.observe(32, 1.5 if n % 10 == 5 else 0.010)      # one period in ten is a stall
    a, b = c.cost.line()
    assert a + 32 * b == pytest.approx(0.010, rel=0.05)
    assert c.cost.stalls >= 15


def test_a_token_keeps_its_measured_cost_through_a_stretch_of_equal_steps():
    """Once steps of different sizes have shown what a token costs, a stretch of steps all of one
    size (B = 1 with speculation off) does not replace it by a guess: there a token would cost an
    eighth of the whole step, and seven drafts most of another step."""
    c = Controller(ControllerSettings(k_max=K))
    for n in range(c.cost.window):
        tokens = 32 + 224 * (n % 2)                      # B = 32, drafting and not
        c.cost.observe(tokens, 0.0053 + 0.00003 * tokens)
    for _ in range(c.cost.window * 2):
        c.cost.observe(1, 0.0053)                        # B = 1, speculation off
    a, b = c.cost.line()
    assert b == pytest.approx(0.00003, rel=0.05) and a == pytest.approx(0.0053, rel=0.05)


@pytest.mark.parametrize("lag", [0, 2, 6])
def test_held_steps_cost_nothing_and_lose_no_probe(lag):
    """While speculation is off and no probe is due, V2's step thread launches steps as plain
    ingests (nothing on the GPU waits for the draft thread), reading the controller up to two steps
    ahead of it. Most off steps go that way, none of them drafts, the probes still come (a probe due
    on a held step waits for the next one) and a draft that starts paying is noticed as soon as
    without holding."""
    from k3_accel.vllm.spec_decode.controller import PROBE_BACKOFF
    interval = 8
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=interval)), batch=4,
                   fixed=0.0053, per_token=0.00004, rt=0.0032)
    t.stale_budget, t.hold_lag = True, lag
    t.accept = lambda step, i, j: False
    t.step(400)
    held = t.c.counters["held_steps"]
    assert held >= 0.7 * 400                                           # most off steps cost nothing
    assert t.c.counters["probe_steps"] >= 2 * 6                        # and probes went on
    t.accept = lambda step, i, j: j < 3
    after = t.step(PROBE_BACKOFF * interval + 40)
    first = next(n for n, d in enumerate(after) if d.sum() > 0)
    assert first <= PROBE_BACKOFF * interval + lag + 2
    assert all(d.sum() > 0 for d in after[first + t.c.s.probe_steps + lag + 2:])


def test_stays_off_only_when_the_next_step_drafts_nothing():
    """Read right before a step, ``stays_off`` never says so for a step the controller would draft
    for (a probe, or speculation on), through regime changes both ways."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=4)), batch=3,
                   fixed=0.0053, per_token=0.00004, rt=0.0032)
    t.stale_budget = True
    said = []
    for phase, accept in enumerate([lambda s, i, j: False, lambda s, i, j: j < 4, lambda s, i, j: False,
                                    lambda s, i, j: i == 0 and j < 2]):
        t.accept = accept
        for _ in range(120):
            said.append(t.c.stays_off())
            t.step(1)
    drafted = [d.sum() > 0 for d in t.asked]
    assert not any(s and d for s, d in zip(said, drafted))
    assert sum(said) >= 100


def test_the_recent_steps_say_why_speculation_went_off():
    """``snapshot()["recent"]``: per step the rows, the period the fit took (or left out as a stall),
    the drafts chosen and whether speculation was off, held or probing: what an operator reads to
    see why drafting stopped."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=4)), batch=2,
                   fixed=0.0053, per_token=0.00004, rt=0.0032)
    t.accept = lambda step, i, j: j < 4
    t.step(TRACE_STEPS)                          # drafting, then 40 steps in which nothing is accepted:
    t.accept = lambda step, i, j: False          # the trace keeps the last TRACE_STEPS of them
    t.stall = lambda step: 1.0 if step == TRACE_STEPS + 15 else 0.0
    t.step(40)
    snap = t.c.snapshot()
    fields, recent = snap["recent_fields"], snap["recent"]
    assert len(recent) == TRACE_STEPS and all(len(r) == len(fields) for r in recent)
    col = {f: [r[i] for r in recent] for i, f in enumerate(fields)}
    assert col["drafts"][:10] != [0] * 10 and col["drafts"][-10:].count(0) >= 5     # on, then off
    assert max(col["off"]) >= 3 and any(col["probe"])
    stalled = [p for p, fitted in zip(col["period_ms"], col["period_fitted"]) if fitted is False]
    assert stalled and min(stalled) > 900                                    # the 1 s step was left out
    assert all(r == 2 for r in col["rows"][-5:]) and set(col["sampling"]) == {2}


@pytest.mark.parametrize("verification", [False, True])
def test_a_probe_lasts_one_step_unless_vllm_verifies_a_step_late(verification):
    """A probe's first step is verified at once by the V1 runner and by V2 without adaptive
    verification: one step of drafts tells whether drafting pays. vLLM's adaptive verification
    sizes a step from the confidences of the step before, so there the probe's first drafts go
    unverified and a second step is needed. Built as the session builds it, from vLLM's config."""
    from k3_accel.config import K3Config
    from k3_accel.vllm.spec_decode.session import TargetFacts, make_controller
    facts = TargetFacts(method="dflash", num_speculative_tokens=K, aux_layer_ids=(1,), hidden_size=8,
                        hidden_dtype=torch.float32, max_rows=64, adaptive_verification=verification)
    t = FakeTarget(make_controller(K3Config(), facts), batch=4)
    t.stale_budget = verification
    t.step(300)
    probing = [bool(d.sum()) for d in t.asked[12:]]                # past the first plain steps (calibration)
    bursts = [len(run) for run in "".join("x" if p else " " for p in probing).split()]
    assert len(bursts) >= 3, bursts
    assert set(bursts) == {2 if verification else 1}, bursts


@pytest.mark.parametrize("overhead", [0.0, 0.008])
def test_drafting_that_slows_the_forward_beyond_its_tokens_is_measured(overhead):
    """A forward that verifies drafts may cost more than its tokens say (a draft server sharing the
    target's processors ingests the accepted rows meanwhile; vLLM's speculative bookkeeping). Measured
    on the forwards that verified drafts, never read into a plain step's cost: with 8 ms more per such
    forward on a 4 ms step, drafts of which three in seven are accepted cost more time than they
    save, and speculation stays off but for its probes; without the overhead they pay and it stays on."""
    t = FakeTarget(Controller(ControllerSettings(k_max=K, probe_interval=8, prior=0.0)), batch=8,
                   fixed=0.0035, per_token=0.00006, rt=0.005)
    t.accept = lambda step, i, j: j < 3
    t.draft_overhead = overhead
    late = t.step(400)[200:]
    drafting = sum(1 for d in late if d.sum() > 0) / len(late)
    if overhead:
        assert drafting <= 0.25, drafting
    else:
        assert drafting >= 0.9, drafting


def test_a_steps_requests_observed_at_once_count_as_observed_one_by_one():
    """The acceptance table takes a step's requests in one pass: the estimates are those of
    observing them one at a time (up to rounding), and a request's counts are its own, also in a
    row a forgotten request used before."""
    from k3_accel.vllm.spec_decode.controller import Acceptance
    s = ControllerSettings(k_max=5)
    rule = Acceptance(s)                             # the rule itself: tried up to the first rejection
    rule.observe_many(["x", "y", "z", "w", "v", "u"], [5, 3, 2, 0, 4, 5], [2, 7, 0, 3, -1, 5])
    assert rule.tried.tolist() == [5, 3, 3, 1, 1]        # positions tried: x 3, y 3 (all accepted), z 1, v 1,
    assert rule.accepted.tolist() == [3, 3, 2, 1, 1]     # u 5, w none; accepted: x 2, y 3, u 5
    rng = np.random.default_rng(7)
    together, alone = Acceptance(s), Acceptance(s)
    pool = [f"r{i}" for i in range(40)]
    for step in range(60):
        ids = list(rng.choice(pool, size=int(rng.integers(1, 33)), replace=False))
        given = rng.integers(0, 6, size=len(ids))
        accepted = rng.integers(-1, 7, size=len(ids))
        together.decay()
        alone.decay()
        together.observe_many(ids, given.tolist(), accepted.tolist())
        for rid, g, a in zip(ids, given.tolist(), accepted.tolist()):
            alone.observe(rid, g, a)
        if step % 7 == 6:
            gone = list(rng.choice(pool, size=5, replace=False))
            together.forget(gone)
            alone.forget(gone)
        np.testing.assert_allclose(together.tried, alone.tried, rtol=1e-12)
        np.testing.assert_allclose(together.accepted, alone.accepted, rtol=1e-12)
        np.testing.assert_allclose(together.rates(pool), alone.rates(pool), rtol=1e-12)
    fresh = Acceptance(s)
    fresh.observe("old", 5, 5)                       # every draft accepted
    fresh.forget(["old"])
    fresh.observe("new", 5, 0)                       # its row may be the old one's: it starts empty
    only_new = Acceptance(s)
    only_new.observe("new", 5, 0)
    only_new.tried, only_new.accepted = fresh.tried.copy(), fresh.accepted.copy()
    np.testing.assert_allclose(fresh.rates(["new", "old"]), only_new.rates(["new", "old"]), rtol=1e-12)
    assert fresh.rates(["new"])[0, 0] < fresh.global_rate()[0]
