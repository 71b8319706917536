"""The target step's cost as the adaptive controller measures it (:mod:`.controller`).

``T(tokens) = a + b * tokens`` by a robust line over the last step periods, and the draft
round trip as the median of the recent waits of proposing steps.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class StepCost:
    """``T(tokens) = a + b * tokens`` by Theil-Sen over the last ``window`` step periods of each kind
    (the median of the pairwise slopes, then the median intercept), and the draft wait ``D`` as the
    median of the last ``window`` waits of proposing steps (one reply seconds late, a server's
    first-use compile, barely moves it; an average held speculation off for hundreds of steps).

    Two kinds of forward, each with its own intercept: plain ones, and those that verified drafts.
    A token costs the same in both (the slope comes from pairs of one kind, so a kind's fixed cost
    is never read as a cost per token), but a forward with drafts to verify may cost more than its
    tokens say: vLLM's speculative bookkeeping, and a draft server that shares the target's
    processors (a CPU box) or its GPU ingesting the accepted rows meanwhile. Predicting a plain step
    from the periods of drafting ones (one line for both) made a plain step look that much dearer and
    kept drafting on where it cost more time than it saved. A kind with fewer than ``min_steps``
    periods borrows the other's intercept (one from all periods while both have that few).

    Robust to stalls (a kernel compile on a GPU engine's first steps, a GC pause): a few
    periods hundreds of times too long move a median little, and once a few steps are measured
    a period over ``stall_factor`` times the fit's prediction is not taken at all (``stalls``),
    unless half the recent periods were: stalls are rare, so then the fit is what is wrong (it
    was learnt from steps unlike the rest) and it learns the new step time instead of locking.
    A least-squares fit, even a decaying one, lets one such period hold speculation off for
    dozens of steps. Until steps of different sizes are seen, a token's marginal cost is taken
    as 1/8 of the average token's.
    """

    window = 24
    stall_factor = 4.0
    min_steps = 4

    def __init__(self, s: Any):
        self.s = s
        # per kind (False: plain forwards, True: forwards that verified drafts): tokens, period (s)
        self.x = {kind: deque(maxlen=self.window) for kind in (False, True)}
        self.y = {kind: deque(maxlen=self.window) for kind in (False, True)}
        self.waits: deque[float] = deque(maxlen=self.window)
        self.stalls = 0
        self._rejected: deque[bool] = deque(maxlen=self.window)   # recent periods taken as stalls
        self._lines: dict[bool, tuple[float, float]] | None = None
        self._slope: float | None = None                          # the last slope measured from spread
        self._wait: float | None = None                           # the median wait (cached)

    @property
    def n(self) -> int:
        return len(self.x[False]) + len(self.x[True])

    def measured(self, drafted: bool) -> int:
        """Periods of that kind in the fit."""
        return len(self.x[bool(drafted)])

    def observe(self, tokens: int, seconds: float, drafted: bool = False) -> bool:
        """Take a step period into the fit (``drafted``: the forward verified drafts); False: left
        out as a stall."""
        drafted = bool(drafted)
        if self.n >= self.min_steps:
            a, b = self.line(drafted)
            stall = seconds > self.stall_factor * (a + b * tokens) > 0 and \
                2 * (sum(self._rejected) + 1) <= self.window
            self._rejected.append(stall)
            if stall:
                self.stalls += 1
                return False
        self.x[drafted].append(float(tokens))
        self.y[drafted].append(float(seconds))
        self._lines = None
        return True

    def observe_round_trip(self, seconds: float) -> None:
        self.waits.append(float(seconds))
        self._wait = None

    @property
    def round_trip(self) -> float | None:
        if self._wait is None and self.waits:
            self._wait = _median(np.asarray(self.waits))
        return self._wait

    def line(self, drafted: bool = False) -> tuple[float, float]:
        """``(a, b)`` of a plain forward (or, ``drafted``, one that verifies drafts), both >= 0."""
        if self._lines is None:
            self._lines = self._fit()
        return self._lines[bool(drafted)]

    def _fit(self) -> dict[bool, tuple[float, float]]:
        kinds = [k for k in (False, True) if self.x[k]]
        if not kinds:
            return {False: (0.0, 0.0), True: (0.0, 0.0)}
        xs = {k: np.asarray(self.x[k]) for k in kinds}
        ys = {k: np.asarray(self.y[k]) for k in kinds}
        x, y = np.concatenate(list(xs.values())), np.concatenate(list(ys.values()))   # every period
        slopes = []
        for k in kinds:
            i, j = _pairs(len(xs[k]))
            dx = xs[k][j] - xs[k][i]
            ok = dx != 0
            slopes.append((ys[k][j] - ys[k][i])[ok] / dx[ok])
        slopes = np.concatenate(slopes)
        if slopes.size:
            b = self._slope = max(_median(slopes), 0.0)
        elif self._slope is not None:          # steps all of one size now: what a token cost when
            b = self._slope                    # sizes last differed (at B = 1, 1/8 of a whole step
        else:                                  # made 7 drafts cost 5 ms on the H200's 8B target)
            b = max(_median(y) / max(_median(x), 1.0) / 8, 0.0)
        own = [k for k in kinds if len(xs[k]) >= self.min_steps]
        if own:
            lines = {k: (max(_median(ys[k] - b * xs[k]), 0.0), b) for k in own}
        else:                                  # too few of either kind: one intercept from all of them
            lines = {False: (max(_median(y - b * x), 0.0), b)}
        first = next(iter(lines.values()))
        return {k: lines.get(k, first) for k in (False, True)}


def _median(v: np.ndarray) -> float:
    """``np.median`` of a small 1-D array without NaNs, the same value (the fit runs every step, and
    ``np.median``'s checks cost more than the sort)."""
    v = np.sort(v)
    n = len(v)
    return float(v[n // 2]) if n % 2 else float((v[n // 2 - 1] + v[n // 2]) / 2)


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.triu_indices(n, k=1)``, made once per ``n`` (the fit runs every step)."""
    if n not in _PAIRS:
        _PAIRS[n] = np.triu_indices(n, k=1)
    return _PAIRS[n]


__all__ = ["StepCost"]
