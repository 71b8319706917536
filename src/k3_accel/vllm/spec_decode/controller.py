"""How many drafts each request gets, per step: speculation that pays or steps aside.

One controller per engine, on the driver rank's draft thread, used by both
runners (:mod:`.pipeline` runs every step through :meth:`Controller.step`).
Before a step goes to the server it picks ``k_i`` in ``0..K`` for every
request that samples, to maximise the expected tokens per second of the next
target step; drafts past ``k_i`` become "no draft", which the runners turn
into nothing to verify (V1: the scheduler gets no placeholder; V2: confidence
0 for vLLM's adaptive verification). When no ``k > 0`` pays for the batch the
step asks the server for nothing (its rows still go, as an ingest), and after
``probe_interval`` such steps ``probe_steps`` steps in a row draft fully so a draft that
starts paying again is noticed; while probes find nothing the interval doubles, up to
``PROBE_BACKOFF`` times, so a useless draft costs ever less (a paying step resets it). A verified
probe whose accepted drafts would pay on their own restarts the acceptance estimate from them (the
rejections before it describe a regime that has ended). Everything it uses is measured:

* **acceptance per position**, per request, smoothed toward a global estimate
  (itself starting from ``prior``): from the valid rows the target kept of the
  drafts this controller handed out the step before, counting only those the
  target verified when the runner says (``StepInput.num_verified``);
* **the target step's time** as ``a + b * tokens`` (a robust line, Theil-Sen, over
  the last step periods it sees, the draft wait taken out; stalls left out), with its own
  ``a`` for forwards that verify drafts (what drafting costs beyond its tokens);
* **the draft round trip**: the median wait of the recent steps that proposed.

With survival ``s_ij`` (request ``i``'s first ``j`` drafts all accepted) the
best prefix of the ``s_ij`` sorted descending maximises
``(B + sum s) / (T(base + m) + D * [m > 0])`` (vLLM's adaptive verification
ranks the same way). The same inputs give the same decisions: no randomness,
time only through the measurements it is fed.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from k3_accel.vllm.spec_decode.acceptance import Acceptance
from k3_accel.vllm.spec_decode.step_cost import StepCost

PROBE_BACKOFF = 4                   # while off, probes back off to at most this x probe_interval
HOLD_MARGIN = 3                     # steps the step thread may run ahead of the draft thread
TRACE_STEPS = 256                   # steps kept in ``snapshot()["recent"]``
TRACE_FIELDS = ("rows", "period_ms", "period_fitted", "sampling", "drafts", "max_k", "off", "held", "probe",
                "wait_ms")


@dataclass(frozen=True)
class ControllerSettings:
    k_max: int
    k_min: int = 0                  # never fewer drafts than this for a sampling request (0: may be off)
    probe_interval: int = 32        # while off, a probe after this many steps: it drafts fully for
    probe_steps: int = 2            # this many steps in a row (vLLM's adaptive verification sizes a
                                    # step's verification from the confidences of the step before: the
                                    # first step's drafts go unverified)
    prior: float = 0.6              # per-position acceptance assumed before any is measured
    prior_weight: float = 4.0       # how many observations the prior is worth (global)
    request_weight: float = 4.0     # how many global observations a request's own estimate starts from
    decay: float = 0.9              # per-step forgetting of acceptance (a memory of ~10 steps)
    min_step_s: float = 1e-5        # a step period below this is not a measurement
    confidence: bool = False        # report the acceptance estimates as the drafts' confidence (vLLM's
                                    # adaptive verification reads it; nothing else does)

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError(f"adaptive_min_k={self.k_min} must be within 0..{self.k_max}")
        if self.probe_interval < 1:
            raise ValueError(f"adaptive_probe_interval={self.probe_interval} must be >= 1")


class Controller:
    """Chooses each step's drafts per request (see the module docstring)."""

    def __init__(self, settings: ControllerSettings, clock: Callable[[], float] = time.perf_counter):
        self.s = settings
        self.clock = clock
        self.acceptance = Acceptance(settings)
        self.cost = StepCost(settings)
        self.given: dict[str, int] = {}        # drafts handed out last step, per request
        self.k_hist: Counter[int] = Counter()
        self.counters: Counter[str] = Counter()
        self._off = 0                          # consecutive steps with speculation off
        self._probing = False                  # the last step's drafts were a probe's
        self._rates: tuple[np.ndarray, np.ndarray] | None = None   # choose's (rows, [rows, K] rates)
        self.last_probe: dict[str, Any] | None = None   # what the last verified probe found (stats)
        self._interval = settings.probe_interval   # off steps before the next probe
        self._last_start: float | None = None
        self._last_wait = 0.0
        # the last steps as the controller saw them (stats: why it chose what it chose)
        self.trace: deque[tuple] = deque(maxlen=TRACE_STEPS)
        self._period: tuple[float, bool] | None = None
        self._observed: set[str] = set()        # requests whose acceptance this step's _learn observed

    # ------------------------------------------------------------------ one step
    def stays_off(self) -> bool:
        """Whether the step being launched may go without drafts unasked: speculation is off and no
        probe is due soon (nor a probe's verdict: it comes the step after). The step thread asks (V2), up to
        ``HOLD_MARGIN`` steps ahead of this thread; a step launched so is ``held``: it drafts
        nothing and a probe that falls due on it waits for the next step that is not."""
        return self.off_budget() >= HOLD_MARGIN

    def off_budget(self) -> int:
        """How many more steps draft nothing before a probe falls due (0 while speculation is on):
        the steps a V1 step thread may hand over without waiting, the choice being known already."""
        if self._off == 0 or self.s.k_min > 0:
            return 0
        return max(0, self._interval - self._off)

    def step(self, inp: Any, run: Callable[..., Any], decided: Callable[[bool], None] | None = None,
             held: bool = False, at: float | None = None) -> Any:
        """Learn from ``inp``, choose, run ``run(inp')`` (the client's step) and mask its drafts.
        ``decided(proposing)`` is called as soon as the choice is made: a step that drafts nothing
        need not hold the GPU while its rows are shipped. Given that (a V2 step: the GPU goes on at
        ``decided(False)``) and while speculation is on, the step is sent as a propose first and the
        choice made while its reply travels: ``run(inp, choose_now)`` calls ``choose_now()`` once the
        message is out (the same choice, off the drafts' critical path; one that drafts nothing
        drops the drafts that come). ``held``: launched without drafts on :meth:`stays_off` (an
        ingest); it counts as a step drafting nothing. ``at``: when the step reached the plugin
        (:attr:`clock`), if it waited in a queue before this call."""
        start = self.clock() if at is None else at
        sampled = np.asarray(inp.sampled, dtype=bool)
        counts = np.asarray(inp.counts, dtype=np.int64)
        choice: list = []

        def decide() -> None:                   # once per step; an error surfaces after the reply
            if choice:
                return
            try:
                self._learn(inp, sampled, counts, start)
                self._rates = None              # choose's, this step only
                ks = self.choose(inp.req_ids, sampled, counts, held) if inp.k > 0 or held else \
                    np.zeros(len(counts), np.int64)
                choice.append(np.minimum(ks, inp.k))
                if decided is not None:
                    decided(bool(choice[0].any()))
            except BaseException as exc:  # noqa: BLE001 - raised below, outside the client's wait
                choice[:] = [exc]

        if decided is not None and inp.k > 0 and not held and self._off == 0:
            try:
                out = run(inp, decide)
            finally:
                decide()                        # not called back: no reply was waited for
        else:
            decide()
            out = None
        if isinstance(choice[0], BaseException):
            raise choice[0]
        ks = choice[0]
        proposing = bool(ks.any())
        if out is None:
            out = run(inp if proposing or inp.k == 0 else dataclasses.replace(inp, k=0))
        if not proposing and inp.k > 0:         # nobody drafts: the rows went (as an ingest, or with a
            out.drafts = torch.full((len(counts), inp.k), -1, dtype=torch.int64)   # propose sent first)
            out.extra.pop("confidence", None)
        if proposing:
            self._last_wait = self.clock() - start
            self.cost.observe_round_trip(self._last_wait)
            ks = self._hinted(inp.req_ids, ks, sampled, counts, out)
        else:
            self._last_wait = 0.0
        self.trace.append((int(counts.sum()), *(self._period or (None, None)), int(np.count_nonzero(sampled)),
                           int(ks.sum()), int(ks.max()) if len(ks) else 0, self._off, bool(held), self._probing,
                           round(self._last_wait * 1e3, 3)))
        drafts = out.drafts
        if proposing and drafts.numel():
            cols = np.arange(drafts.shape[1])
            d = drafts.numpy()
            d[cols[None, :] >= ks[:, None]] = -1
            given = (d >= 0).sum(axis=1)
            self.given = {rid: int(g) for rid, g, s in zip(inp.req_ids, given, sampled) if s}
            if self.s.confidence and not self._probing:
                mine, theirs = self._confidence(inp.req_ids, d), out.extra.get("confidence")
                out.extra["confidence"] = mine if theirs is None else \
                    torch.where(theirs >= 0, theirs.to(torch.float32), mine)
        else:                                   # nothing handed out (the drafts are all -1)
            self.given = {}
        return out

    def _confidence(self, req_ids: Sequence[str], drafts: np.ndarray) -> torch.Tensor:
        """``[R, k]`` float32: the estimated acceptance of each draft handed out (-1 where none), where
        the server sends no confidence of its own. vLLM's adaptive verification ranks a step's draft
        slots by their running product and sizes the next step's budget from them: with all 1 every
        slot ties, and a budget the step before sized leaves arbitrary requests short, so they fall
        out of step. A probe sends none: its drafts must be verified to say anything."""
        if self._rates is not None:
            rows, known = self._rates              # choose's, for the requests that sample (no others drafts)
            rates = np.ones((len(req_ids), self.s.k_max))
            rates[rows] = known
            rates = rates[:, :drafts.shape[1]]
        else:
            rates = self.acceptance.rates(req_ids)[:, :drafts.shape[1]]
        return torch.from_numpy(np.where(drafts >= 0, rates, -1.0).astype(np.float32))

    def _hinted(self, req_ids: Sequence[str], ks: np.ndarray, sampled: np.ndarray, counts: np.ndarray,
                out: Any) -> np.ndarray:
        """With the server's per-draft confidence (DSpark's confidence head: ``out.extra
        ["confidence"]``, -1 = none) the drafts of this very step are ranked by it instead of by
        the acceptance history: request ``i``'s ``j``-th draft survives with the product of its
        first ``j`` confidences, and the same cost model picks the prefix. Only ever fewer drafts
        than chosen before the step (the round trip is already paid). The drafts it trims are never
        verified: their confidence counts as what they would have been (expected counts), or a draft
        the server doubts throughout left the history that paid proposing every step for nothing."""
        conf = getattr(out, "extra", {}).get("confidence")
        if conf is None or not len(ks):
            return ks
        c = np.asarray(conf, dtype=np.float64)
        rows = np.flatnonzero(sampled & (ks > 0) & (c[:, 0] >= 0))
        if rows.size == 0:
            return ks
        k = min(c.shape[1], int(ks.max()))
        surv = np.cumprod(np.clip(c[rows, :k], 0.0, 1.0), axis=1)
        expected = surv.copy()
        surv[np.arange(k)[None, :] >= ks[rows, None]] = 0.0          # never past the earlier choice
        others = np.ones(len(ks), dtype=bool)
        others[rows] = False
        base = float(np.count_nonzero(sampled) + counts[~sampled].sum() + ks[others].sum())
        chosen = _best_prefix(surv, int(np.count_nonzero(sampled)), self.cost.line(False), self.cost.line(True),
                              base, 0.0, min(self.s.k_min, k))
        trimmed = ks.copy()
        trimmed[rows] = np.minimum(ks[rows], chosen)
        self.counters["hint_trimmed_drafts"] += int((ks - trimmed).sum())
        pos = np.arange(k)[None, :]
        drafted = out.drafts.numpy()[rows, :k] >= 0          # (a request not proposed for has confidence 0)
        cut = (pos >= trimmed[rows, None]) & (pos < ks[rows, None]) & (c[rows, :k] >= 0) & drafted
        learn = cut.any(axis=1) & np.isfinite(expected).all(axis=1)
        if learn.any():                          # what the trimmed drafts would have been, as expected counts
            reach = np.hstack([np.ones((len(rows), 1)), expected[:, :-1]])
            tried, accepted = np.zeros((int(learn.sum()), self.s.k_max)), np.zeros((int(learn.sum()), self.s.k_max))
            tried[:, :k], accepted[:, :k] = np.where(cut, reach, 0.0)[learn], np.where(cut, expected, 0.0)[learn]
            if not self._observed:               # the step's news: forget as _learn does
                self.acceptance.decay()
            self.acceptance.observe_expected([req_ids[i] for i in rows[learn].tolist()], tried, accepted,
                                             self._observed)
        return trimmed

    def _learn(self, inp: Any, sampled: np.ndarray, counts: np.ndarray, start: float) -> None:
        """The valid rows of a sampling request are 1 + the drafts it had accepted, of the drafts
        handed out to it last step that the target verified (``inp.num_verified`` when the runner
        knows it: vLLM's adaptive verification may verify none of them, which is no rejection)."""
        verified = inp.num_verified
        seen = []
        for n, (rid, s, c) in enumerate(zip(inp.req_ids, sampled.tolist(), counts.tolist())):
            g = self.given.get(rid, 0) if s else 0
            if g and verified is not None:
                g = min(g, int(verified[n]))
            if g:
                seen.append((rid, g, c - 1))
        self._observed = {x[0] for x in seen}
        if seen:                           # forget only when there is news (an off stretch keeps what it knew)
            self.acceptance.decay()
            self.acceptance.observe_many([x[0] for x in seen], [x[1] for x in seen], [x[2] for x in seen])
        if seen and self._probing:
            self._judge_probe(seen, sampled, counts)
        # the forward that just ran (between the last step's end and this one's start) verified
        # the drafts handed out last step: its tokens are the rows plus the rejected drafts
        tokens = int(counts.sum()) + sum(max(0, g - accepted) for _, g, accepted in seen)
        self._period = None
        if self._last_start is not None:
            period = start - self._last_start - self._last_wait
            if period > self.s.min_step_s:
                self._period = (round(period * 1e3, 3), self.cost.observe(tokens, period, bool(seen)))
        self._last_start = start

    def _judge_probe(self, seen: list, sampled: np.ndarray, counts: np.ndarray) -> None:
        """A verified probe whose accepted drafts would pay on their own (the batch's survival from
        this step's counts alone, under the same cost model) restarts the global estimate from them:
        the rejections before it, however many, describe a regime that has ended, and outweighing
        one fresh probe with them kept speculation off for whole runs. One that would not pay is
        just more evidence."""
        k = self.s.k_max
        tried, accepted = np.zeros(k), np.zeros(k)
        for _, g, a in seen:
            a = max(0, min(a, g))
            tried[:min(a + 1, g)] += 1
            accepted[:a] += 1
        rate = np.divide(accepted, tried, out=np.zeros(k), where=tried > 0)
        n = int(np.count_nonzero(sampled))
        if n == 0 or self.cost.n < 1.0:
            return
        a, b = self.cost.line()
        rt = self.cost.round_trip or 0.0
        base = float(n + counts[~sampled].sum())
        pays = bool(_best_prefix(np.tile(np.cumprod(rate), (n, 1)), n, (a, b), self.cost.line(True), base, rt,
                                 0).any())
        self.counters["probes_judged"] += 1
        self.last_probe = {"acceptance": [round(float(x), 3) for x in rate], "pays": pays,
                           "step_ms": round(a * 1e3, 3), "per_token_ms": round(b * 1e3, 5),
                           "step_with_drafts_ms": round(self.cost.line(True)[0] * 1e3, 3),
                           "round_trip_ms": round(rt * 1e3, 3)}
        if pays:
            self.acceptance.restart(tried, accepted)
            self.counters["probe_restarts"] += 1

    def choose(self, req_ids: Sequence[str], sampled: np.ndarray, counts: np.ndarray,
               held: bool = False) -> np.ndarray:
        """``[R]`` drafts per request for the next step (0 for requests that do not sample; all 0
        when ``held``, see :meth:`step`)."""
        k = self.s.k_max
        idx = np.flatnonzero(sampled)
        ks = np.zeros(len(req_ids), dtype=np.int64)
        self._probing = False
        if idx.size == 0 or k == 0:
            return ks
        if self.cost.n < 1.0:                   # no step measured yet: draft fully (and measure)
            ks[idx] = k
            self.k_hist[k] += int(idx.size)
            return ks
        if self.s.k_min == 0 and self.cost.measured(False) < self.cost.min_steps and self.given:
            # what a plain forward costs is measured, never borrowed from forwards that verified
            # drafts (those may cost more than their tokens say): until a few are, every other step
            # while drafting is plain
            self.counters["calibration_steps"] += 1
            self.k_hist[0] += int(idx.size)
            return ks
        rates = self.acceptance.rates([req_ids[i] for i in idx])
        self._rates = (idx, rates)               # the step's drafts' confidence reads them again
        surv = np.cumprod(rates, axis=1)
        rt = self.cost.round_trip or 0.0
        base = float(idx.size + counts[~sampled].sum())          # next step's tokens without drafts
        chosen = _best_prefix(surv, idx.size, self.cost.line(False), self.cost.line(True), base, rt, self.s.k_min)
        if not chosen.any() and self.s.k_min == 0:
            self._off += 1
            self.counters["off_steps"] += 1
            if self._off > self._interval + self.s.probe_steps:     # the last probe found nothing:
                self._off = 1                                        # back off, up to PROBE_BACKOFF x
                self._interval = min(self._interval * 2, self.s.probe_interval * PROBE_BACKOFF)
            if self._off > self._interval and held:
                self._off = self._interval                           # the probe waits for the next step
            elif self._off > self._interval:
                chosen[:] = k
                self._probing = True
                self.counters["probe_steps"] += 1
        else:
            if held:                                 # it would pay again (the thread was behind):
                chosen[:] = 0                        # the next step drafts
            self._off, self._interval = 0, self.s.probe_interval
        if held:
            self.counters["held_steps"] += 1
        ks[idx] = chosen
        self.k_hist.update(chosen.tolist())
        self.counters["steps"] += 1
        return ks

    def forget(self, req_ids: Sequence[str]) -> None:
        self.acceptance.forget(req_ids)
        for rid in req_ids:
            self.given.pop(rid, None)

    def snapshot(self) -> dict[str, Any]:
        a, b = self.cost.line()
        return {"k_chosen": {str(k): n for k, n in sorted(self.k_hist.items())},
                "acceptance_per_position": [round(float(x), 4) for x in self.acceptance.global_rate()],
                "step_ms": {"fixed": round(a * 1e3, 4), "per_token": round(b * 1e3, 6),
                            "fixed_with_drafts": round(self.cost.line(True)[0] * 1e3, 4)},
                "round_trip_ms": None if self.cost.round_trip is None else round(self.cost.round_trip * 1e3, 4),
                "stalled_steps": self.cost.stalls, "last_probe": self.last_probe, **self.counters,
                "recent_fields": TRACE_FIELDS, "recent": [list(t) for t in self.trace]}


def _best_prefix(surv: np.ndarray, batch: int, off: tuple[float, float], on: tuple[float, float], base: float,
                 rt: float, k_min: int) -> np.ndarray:
    """Drafts per request: the prefix of the sorted survivals that maximises tokens per second;
    ``off`` / ``on``: the ``(a, b)`` of a forward without drafts / with drafts to verify."""
    r, k = surv.shape
    fixed = np.zeros(r, dtype=np.int64) + k_min
    free = surv[:, k_min:]
    order = np.argsort(-free, axis=None, kind="stable")
    gains = free.reshape(-1)[order]
    m = np.arange(len(gains) + 1)
    tokens = np.concatenate(([0.0], np.cumsum(gains))) + batch + surv[:, :k_min].sum()
    extra = m + r * k_min
    drafting = extra > 0
    cost = np.where(drafting, on[0] + on[1] * (base + extra) + rt, off[0] + off[1] * (base + extra))
    rate = tokens / np.maximum(cost, 1e-12)
    best = int(np.argmax(rate))                   # ties: the fewest drafts
    chosen = fixed.copy()
    if best:
        rows = order[:best] // free.shape[1]
        np.add.at(chosen, rows, 1)
    return chosen


__all__ = ["Acceptance", "Controller", "ControllerSettings", "StepCost"]
