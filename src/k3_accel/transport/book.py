"""The client's request book: what it knows about each request's remote context.

Request ids become integer handles at first sight (never reused within the
session); the server keys state by handle. The book admits at most the
server's per-session request limit at once: a request beyond it is simply
not drafted (counted, logged once), never an error storm. Failures queued by
any thread disable their requests at the next :meth:`RequestBook.apply`;
a request disabled by a request-level failure gets no drafts until it leaves
the batch; one disabled because the link was down drafts again once it is back
(:meth:`RequestBook.rearm`). Frees that
could not be sent are kept, without a cap, and sent once the connection is
back (and dropped when the server's state is gone anyway).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from k3_accel.transport.failures import Failure, FailureKind, FailureQueue
from k3_accel.transport.timing import Telemetry

log = logging.getLogger("k3_accel.transport")

# failures that are routine (a request's own trouble), logged at INFO
_QUIET = (FailureKind.REQUEST, FailureKind.COLD_START, FailureKind.RECONNECT, FailureKind.CLIENT_GAP,
          FailureKind.NOT_CONNECTED, FailureKind.CAPACITY, FailureKind.OUT_OF_VOCAB)


# failures of the link, not of a request's context: such requests draft again once it is back
_LINK_FAILURES = (FailureKind.TRANSPORT, FailureKind.NOT_CONNECTED, FailureKind.SERVER_RESTART,
                  FailureKind.RING_TIMEOUT, FailureKind.SENDER)


@dataclass(eq=False, slots=True)
class Record:
    handle: int
    length: int = 0                  # rows the server holds once everything sent is handled
    disabled: str | None = None      # why it gets no drafts (until it leaves the batch)
    sent: bool = False               # rows of it went out at least once
    epoch: int = 0                   # the book's epoch when it was created
    kind: FailureKind | None = None  # the failure that disabled it
    resync: bool = False             # drafting again: its next rows must bring its token history
    born: float = field(default_factory=time.monotonic)


class RequestBook:
    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry
        self.failures = FailureQueue()
        self.records: dict[str, Record] = {}
        self.limit = 0                       # the server's per-session request limit (0: none known)
        self.epoch = 0                       # bumped when the server's state is gone
        self._next_handle = 0
        self._active = 0                     # admitted records (not disabled for capacity)
        self._unsent_frees: list[tuple[list[int], bool]] = []
        self._logged_capacity = False
        self.history_wanted: frozenset[str] = frozenset()   # read by other threads: replaced, never mutated

    # -------------------------------------------------------------- lookups
    def resolve(self, req_ids: Sequence[str]) -> list[Record]:
        """The records of a step's requests; new ones get a handle (or no admission)."""
        records = self.records
        out = [records.get(rid) for rid in req_ids]
        if None in out:
            for i, rid in enumerate(req_ids):
                if out[i] is None:
                    out[i] = records[rid] = self._new(rid)
        return out

    def _new(self, req_id: str) -> Record:
        rec = Record(self._next_handle, epoch=self.epoch)
        self._next_handle += 1
        if self.limit and self._active >= self.limit:
            rec.disabled = f"{FailureKind.CAPACITY.value}: the server admits {self.limit} requests per client"
            self.telemetry.count("over_capacity")
            if not self._logged_capacity:
                self._logged_capacity = True
                log.warning("k3 draft: more running requests than the draft server admits per client (%d); "
                            "the excess is not drafted (counted as over_capacity)", self.limit)
        else:
            self._active += 1
        return rec

    def get(self, req_id: str) -> Record | None:
        return self.records.get(req_id)

    def is_disabled(self, req_id: str) -> bool:
        rec = self.records.get(req_id)
        return rec is not None and rec.disabled is not None

    # ------------------------------------------------------------- departures
    def finish(self, req_ids: Iterable[str]) -> tuple[list[int], list[int]]:
        """Forget requests that left the batch; ``(retain, drop)`` handles to free remotely. A
        disabled request is kept too: whatever the server holds of it is a correct prefix of its
        sequence (rows are applied whole or not at all, and a reattach is matched by token ids), so
        a later request with its prompt can still reattach to it."""
        retain, drop = [], []
        for rid in req_ids:
            rec = self.records.pop(rid, None)
            if rec is None:
                continue
            if not (rec.disabled or "").startswith(FailureKind.CAPACITY.value):
                self._active -= 1
            if rec.epoch != self.epoch or not rec.sent:
                continue                     # nothing of it on the server
            (retain if rec.length > 0 or rec.resync else drop).append(rec.handle)
        return retain, drop

    def hold_frees(self, handles: list[int], retain: bool) -> None:
        self._unsent_frees.append((handles, retain))

    def take_unsent_frees(self) -> list[tuple[list[int], bool]]:
        frees, self._unsent_frees = self._unsent_frees, []
        return frees

    def server_state_lost(self) -> None:
        """The server no longer holds anything of ours (restart, lease expired)."""
        self.epoch += 1
        self._unsent_frees.clear()

    # --------------------------------------------------------------- failures
    def apply(self) -> bool:
        """Drain the failure queue at once and disable every affected request; True if any
        failure was drained."""
        if not len(self.failures):
            return False
        for failure in self.failures.drain():
            self.telemetry.count(f"failures.{failure.kind.value}")
            if failure.kind is FailureKind.CAPTURE:
                continue
            self._disable(failure)
        return True

    def _disable(self, failure: Failure) -> None:
        if failure.all_requests:
            targets = [(i, r) for i, r in self.records.items() if r.born <= failure.at]
        else:
            targets = [(i, self.records[i]) for i in failure.ids if i in self.records]
        newly = [(rid, rec) for rid, rec in targets if rec.disabled is None]
        for _, rec in newly:
            rec.disabled, rec.kind = f"{failure.kind.value}: {failure.detail}", failure.kind
        self.telemetry.count("disabled_requests", len(newly))
        if newly:
            level = logging.INFO if failure.kind in _QUIET else logging.WARNING
            names = ", ".join(rid for rid, _ in newly[:4]) + ("..." if len(newly) > 4 else "")
            log.log(level, "k3 draft: %s failure disables %d request(s) (%s): %s", failure.kind.value,
                    len(newly), names, failure.detail)

    def rearm(self) -> int:
        """The link is back: requests disabled only because the link was down draft again,
        attached anew from their token history at their next rows (the server rebuilds what it
        can, or reuses what it still holds). Returns how many."""
        n = 0
        for rec in self.records.values():
            if rec.kind in _LINK_FAILURES:
                # the same server may still hold what was sent of it: freed when it leaves (``sent``)
                rec.sent = rec.sent and rec.epoch == self.epoch
                rec.disabled, rec.kind, rec.length, rec.resync, rec.epoch = None, None, 0, True, self.epoch
                n += 1
        if n:
            self.telemetry.count("rearmed_requests", n)
            log.info("k3 draft: the draft server is back; %d request(s) draft again", n)
        self.history_wanted = frozenset(rid for rid, rec in self.records.items() if rec.resync)
        return n

    def attached(self, rec: Record) -> None:
        """``rec`` got its history (or sits out for good): stop asking for it."""
        if rec.resync:
            rec.resync = False
            self.history_wanted = frozenset(rid for rid, r in self.records.items() if r.resync)

    def stats(self) -> dict:
        return {"tracked": len(self.records), "admitted": self._active,
                "disabled": sum(r.disabled is not None for r in self.records.values()),
                "unsent_frees": sum(len(h) for h, _ in self._unsent_frees)}
