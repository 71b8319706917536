"""The adaptive controller's acceptance estimate (:mod:`.controller`): per position, globally and
per request, as decayed (tried, accepted) counts smoothed toward the global rate (itself smoothed
toward the settings' prior)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from k3_accel.vllm.spec_decode.controller import ControllerSettings


class Acceptance:
    """Per-position acceptance: global counts plus each request's own, both as (tried, accepted).
    A request's counts are a row of one table (found through its id), so a step's requests are
    observed and read in a few array operations, not a few per request."""

    def __init__(self, s: "ControllerSettings"):
        self.s = s
        self.tried = np.zeros(s.k_max)
        self.accepted = np.zeros(s.k_max)
        self._row: dict[str, int] = {}                   # id -> row of ``_counts``
        self._counts = np.zeros((16, 2, s.k_max))         # [rows, tried / accepted, K]
        self._spare: list[int] = []                      # rows of forgotten requests
        self._pos = np.arange(s.k_max)

    def observe(self, req_id: str, given: int, accepted: int) -> None:
        """``given`` drafts were verified, the first ``accepted`` of them were accepted."""
        self.observe_many([req_id], [given], [accepted])

    def observe_many(self, req_ids: Sequence[str], given: Sequence[int], accepted: Sequence[int]) -> None:
        """:meth:`observe` for each request of a step (distinct ids), at once."""
        g, a = np.array(given, dtype=np.int64), np.array(accepted, dtype=np.int64)
        ids = req_ids
        if not g.size or g.min() <= 0:                   # requests with nothing verified: nothing to learn
            keep = g > 0
            ids, g, a = [rid for rid, k in zip(req_ids, keep.tolist()) if k], g[keep], a[keep]
            if not ids:
                return
        a = np.minimum(np.maximum(a, 0), g)
        tried = np.minimum(a + 1, g)                     # positions past the first rejection were not tried
        rows = np.fromiter((self._row_of(rid) for rid in ids), dtype=np.int64, count=len(ids))
        t_mask, a_mask = self._pos < tried[:, None], self._pos < a[:, None]
        counts = self._counts[rows] * self.s.decay
        counts[:, 0] += t_mask
        counts[:, 1] += a_mask
        self._counts[rows] = counts
        self.tried += t_mask.sum(axis=0)
        self.accepted += a_mask.sum(axis=0)

    def observe_expected(self, req_ids: Sequence[str], tried: np.ndarray, accepted: np.ndarray,
                         decayed: frozenset | set = frozenset()) -> None:
        """Expected counts ``[R, K]`` (drafts never verified: a server's confidence in them, see
        :meth:`~.controller.Controller._hinted`); ``decayed``: requests already observed this step."""
        rows = np.fromiter((self._row_of(rid) for rid in req_ids), dtype=np.int64, count=len(req_ids))
        scale = np.fromiter((1.0 if rid in decayed else self.s.decay for rid in req_ids), dtype=float,
                            count=len(req_ids))
        counts = self._counts[rows] * scale[:, None, None]
        counts[:, 0] += tried
        counts[:, 1] += accepted
        self._counts[rows] = counts
        self.tried += tried.sum(axis=0)
        self.accepted += accepted.sum(axis=0)

    def _row_of(self, req_id: str) -> int:
        row = self._row.get(req_id)
        if row is None:
            if self._spare:
                row = self._spare.pop()
            else:
                row = len(self._row)
                if row >= self._counts.shape[0]:
                    self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._counts[row] = 0.0
            self._row[req_id] = row
        return row

    def decay(self) -> None:
        self.tried *= self.s.decay
        self.accepted *= self.s.decay

    def restart(self, tried: np.ndarray, accepted: np.ndarray) -> None:
        """The global estimate from these counts alone: what came before describes a regime that ended."""
        self.tried, self.accepted = tried.astype(float), accepted.astype(float)

    def global_rate(self) -> np.ndarray:
        w = self.s.prior_weight
        return (self.accepted + w * self.s.prior) / (self.tried + w)

    def rates(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[R, K]``: each request's acceptance at position j+1, given the drafts before it were accepted."""
        g = self.global_rate()
        w = self.s.request_weight
        rows = np.fromiter((self._row.get(rid, -1) for rid in req_ids), dtype=np.int64, count=len(req_ids))
        rates = np.broadcast_to(g, (len(req_ids), self.s.k_max)).copy()
        known = np.flatnonzero(rows >= 0)
        if known.size:
            counts = self._counts[rows[known]]                          # [R', 2, K]: tried, accepted
            rates[known] = (counts[:, 1] + w * g) / (counts[:, 0] + w)
        return rates

    def forget(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self._spare.append(row)


__all__ = ["Acceptance"]
