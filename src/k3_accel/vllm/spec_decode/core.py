"""The runner-independent half of remote drafting: one step, the same on V1 and V2.

An adapter (:mod:`.v1`, :mod:`.v1_ngram`, :mod:`.v2`) reads vLLM's batch into
request ids, the skip mask and a ``build`` callback that makes the step's
:class:`~k3_accel.transport.api.StepInput`; :meth:`RemoteDrafter.step` does the
rest and returns ``[R, k]`` drafts with the transport's "no draft" (-1), which
the adapter converts to what its runner needs.

Every TP rank calls :meth:`RemoteDrafter.step` in lockstep and takes the same
decisions from host-side data only (request ids, the skip rule, the known
book); only the driver rank (TP rank 0) builds the input and talks to the
server.
"""
from __future__ import annotations

import collections
import logging
import sys
from typing import Any, Callable, Container, Iterable, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput

log = logging.getLogger("k3_accel.vllm")

MAX_LOGGED_FAILURES = 3
NO_LIMIT = np.iinfo(np.int64).max      # max_tokens of a request without a limit


def finishes_after_prefill(max_tokens: np.ndarray) -> np.ndarray:
    """``[R]`` bool: the skip rule. A request that emits at most one token
    (``max_tokens <= 1``) finishes with the step that samples its first token,
    so it needs neither drafts nor remote context."""
    return np.asarray(max_tokens, dtype=np.int64) <= 1


class KnownRequests:
    """Request ids the server has been told about, to free them when they leave vLLM."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def new(self, req_ids: Iterable[str]) -> list[str]:
        """The ids seen for the first time (now known), in order."""
        fresh = [r for r in req_ids if r not in self.ids]
        self.ids.update(fresh)
        return fresh

    def departed(self, live: Container[str]) -> list[str]:
        """Known ids no longer in ``live`` (now forgotten), sorted."""
        gone = sorted(r for r in self.ids if r not in live)
        self.ids.difference_update(gone)
        return gone

    def forget(self, req_ids: Iterable[str]) -> None:
        self.ids.difference_update(req_ids)


class FailureLog:
    """Counts failures (``failures`` and ``failures.<kind>``); the first few are logged with
    their traceback, later ones at debug level, so a dead server cannot flood the log.
    Call :meth:`record` inside the ``except`` block (outside one, nothing but the message)."""

    def __init__(self, counters: collections.Counter, limit: int = MAX_LOGGED_FAILURES):
        self.counters = counters
        self.limit = limit

    def record(self, kind: str, what: str, outcome: str = "this step gets no drafts") -> None:
        self.counters["failures"] += 1
        self.counters[f"failures.{kind}"] += 1
        exc_info = sys.exc_info()[0] is not None      # the deadline's failures have no exception
        if self.counters["failures"] <= self.limit:
            log.error("k3-accel: %s failed; %s", what, outcome, exc_info=exc_info)
        else:
            log.debug("k3-accel: %s failed; %s", what, outcome, exc_info=exc_info)


Build = Callable[[np.ndarray, list], StepInput]


class RemoteDrafter:
    """One engine's remote drafting: the session, the known-request book, counters, failures."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self.counters: collections.Counter = collections.Counter()
        self.failures = FailureLog(self.counters)
        self.known = KnownRequests()
        self.session: Any = None
        self.on_free: Callable[[list[str]], None] | None = None   # drops the adapter's own rows of freed requests

    def open(self, vllm_config: Any, device: torch.device | str, device_rows: bool = False,
             ring: bool = False) -> None:
        """Connect (TP rank 0) and join the broadcast; idempotent while open. ``device_rows``: the
        steps hand the transport hidden rows on ``device`` (V1), which the device plane may carry;
        ``ring``: the V2 launch compacts them into the session's device ring."""
        if self.session is None:
            from k3_accel.vllm.spec_decode.session import RemoteDraftSession
            self.device = torch.device(device)
            self.session = RemoteDraftSession(vllm_config, self.device, self.failures, device_rows, ring)

    @property
    def ships_hidden(self) -> bool:
        return self.session is not None and self.session.ships_hidden

    def admit(self, req_ids: Sequence[str], skip: np.ndarray, live: Container[str] | None = None
              ) -> tuple[np.ndarray, list[str]] | None:
        """The host-side half of a step, the same on every rank: frees the known requests
        not in ``live`` (vLLM dropped them), then returns ``(keep, fresh)``: the kept batch
        indices (``skip[i]``: request ``i`` is left out: no context, no draft) and the kept
        ids whose token history the step must carry: seen for the first time, or drafting
        again after an outage. None: nothing to do remotely this step."""
        if live is not None:
            self.free_departed(live)
        r = len(req_ids)
        keep = np.flatnonzero(~np.asarray(skip, dtype=bool)[:r])
        if keep.size < r:
            self.counters["skipped_requests"] += r - int(keep.size)
        if self.session is None or keep.size == 0:
            if r and self.session is not None:
                self.counters["skipped_steps"] += 1
            return None
        self.counters["steps"] += 1
        kept = [req_ids[i] for i in keep.tolist()]
        fresh = self.known.new(kept)
        again = self.session.wants_history()
        if again:                          # drafting again after an outage: they need their history too
            seen = set(fresh)
            fresh += [rid for rid in kept if rid in again and rid not in seen]
        return keep, fresh

    def step(self, req_ids: Sequence[str], *, skip: np.ndarray, k: int, build: Build,
             live: Container[str] | None = None, pad_to: int | None = None) -> torch.Tensor:
        """Drafts ``[pad_to, k]`` int64 (``pad_to`` defaults to ``len(req_ids)``; padding rows
        and skipped requests get no draft, -1), identical on every TP rank (the V1 runners).

        See :meth:`admit`. The driver calls ``build(keep, fresh)`` with the kept batch
        indices and the kept ids seen for the first time; an exception there fails the
        step closed.
        """
        rows = len(req_ids) if pad_to is None else pad_to
        plan = self.admit(req_ids, skip, live)
        if plan is None:
            return self._no_drafts(rows, k)
        keep, fresh = plan
        inp = None
        if self.session.is_driver and not self.session.link_down([req_ids[i] for i in keep.tolist()]):
            try:
                inp = build(keep, fresh)
            except Exception:  # noqa: BLE001 - fail closed: None = no drafts, still broadcast
                self.failures.record("step_input", "building the step input")
        drafts = self.session.step(inp, int(keep.size), k)
        if keep.size == rows:
            return drafts
        out = self._no_drafts(rows, k)
        out[torch.from_numpy(keep).to(out.device)] = drafts
        return out

    def _no_drafts(self, rows: int, k: int) -> torch.Tensor:
        return torch.full((rows, k), -1, dtype=torch.int64, device=self.device)

    def free_departed(self, live: Container[str]) -> None:
        """Free the known requests vLLM dropped (finished or preempted) since the last step."""
        gone = self.known.departed(live) if len(self.known) else []
        if gone and self.on_free is not None:
            try:
                self.on_free(gone)
            except Exception:  # noqa: BLE001 - never raise into the step (the other TP ranks wait)
                self.failures.record("free", "dropping departed requests' held rows")
        if gone and self.session is not None:
            try:
                self.session.finish(gone)
            except Exception:  # noqa: BLE001
                self.failures.record("free", "freeing departed requests", "the server may keep them")

    def stats(self) -> dict[str, Any]:
        """The transport's statistics (rank 0) plus the adapter's counters under ``adapter``."""
        transport = self.session.stats() if self.session is not None else {}
        return {**transport, "adapter": {**self.counters, "known_requests": len(self.known)}}

    def close(self) -> None:
        """Drop the connection (idempotent, never raises); no drafts from here on."""
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - shutdown must not raise
                log.debug("k3-accel: closing the draft session failed", exc_info=True)
