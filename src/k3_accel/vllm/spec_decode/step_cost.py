"""The target step's cost as the adaptive controller measures it (:mod:`.controller`).

``T(tokens) = a + b * tokens`` by a robust line over the last step periods, and the draft
round trip as the median of the recent waits of proposing steps.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class StepCost:
    """``T(tokens) = a + b * tokens`` by Theil-Sen over the last ``window`` step periods (the
    median of the pairwise slopes, then the median intercept); the draft wait ``D`` as the median
    of the last ``window`` waits of proposing steps (one reply seconds late, a server's first-use
    compile, barely moves it; an average held speculation off for hundreds of steps).

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
        self.x: deque[float] = deque(maxlen=self.window)     # tokens of each measured step
        self.y: deque[float] = deque(maxlen=self.window)     # its period (seconds)
        self.waits: deque[float] = deque(maxlen=self.window)
        self.stalls = 0
        self._rejected: deque[bool] = deque(maxlen=self.window)   # recent periods taken as stalls
        self._line: tuple[float, float] | None = None
        self._slope: float | None = None                          # the last slope measured from spread
        self._wait: float | None = None                           # the median wait (cached)

    @property
    def n(self) -> int:
        return len(self.x)

    def observe(self, tokens: int, seconds: float) -> bool:
        """Take a step period into the fit; False: left out as a stall."""
        if self.n >= self.min_steps:
            a, b = self.line()
            stall = seconds > self.stall_factor * (a + b * tokens) > 0 and \
                2 * (sum(self._rejected) + 1) <= self.window
            self._rejected.append(stall)
            if stall:
                self.stalls += 1
                return False
        self.x.append(float(tokens))
        self.y.append(float(seconds))
        self._line = None
        return True

    def observe_round_trip(self, seconds: float) -> None:
        self.waits.append(float(seconds))
        self._wait = None

    @property
    def round_trip(self) -> float | None:
        if self._wait is None and self.waits:
            self._wait = _median(np.asarray(self.waits))
        return self._wait

    def line(self) -> tuple[float, float]:
        """``(a, b)``, both >= 0."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        if not self.x:
            return 0.0, 0.0
        x, y = np.asarray(self.x), np.asarray(self.y)
        i, j = _pairs(len(x))
        dx = x[j] - x[i]
        ok = dx != 0
        if ok.any():
            b = self._slope = max(_median((y[j] - y[i])[ok] / dx[ok]), 0.0)
        elif self._slope is not None:          # steps all of one size now: what a token cost when
            b = self._slope                    # sizes last differed (at B = 1, 1/8 of a whole step
        else:                                  # made 7 drafts cost 5 ms on the H200's 8B target)
            b = max(_median(y) / max(_median(x), 1.0) / 8, 0.0)
        return max(_median(y - b * x), 0.0), b


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
