"""``DraftClient``: one target's connection to the draft server, driven once per step.

Per step (:meth:`DraftClient.step`):

1. resolve the step's requests in the book (handles; admission; disabled ones sit out);
2. pick the groups: requests that want drafts (sampled, ``k > 0``) -> one
   ``propose``; requests that only ship rows -> ``ingest``; new requests whose
   rows start past 0 (a prefix-cache hit) get a ``reconnect`` first;
3. copy the rows into the oldest free staging slot (back-pressure when none);
4. **deferred** (no propose): the copy runs on a side stream and the sender
   thread sends once it is done; the step returns at once. **Synchronous**
   (a propose): wait until earlier deferred ingests are on the wire, send,
   wait for the propose's reply only.

Messages over the server's size limit are split. Failures never raise out of
:meth:`step` (except :class:`StepInputError` for an inconsistent input):
they turn drafts into -1 and disable the affected requests; those disabled
only because the link was down draft again once it is back (their next rows
bring their token history). A propose whose reply is later than
``propose_timeout_ms`` leaves that step without drafts and nothing disabled.
Draft ids outside the target's vocabulary become "no draft".
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable

import numpy as np
import torch

from k3_accel import protocol as p
from k3_accel.transport import attach, layout
from k3_accel.transport.api import ClientSettings, StepInput, StepOutput
from k3_accel.transport.book import RequestBook
from k3_accel.transport.capture import CaptureWriter, submit_step
from k3_accel.transport.connection import Pending, ReplyLate
from k3_accel.transport.device_plane import DevicePlane, DeviceRing
from k3_accel.transport.failures import FailureKind, RingTimeout, StepInputError, TransportError
from k3_accel.transport.link import Link, State
from k3_accel.transport.outbox import Outbox
from k3_accel.transport.replies import ReplyReader
from k3_accel.transport.sender import Sender, SendJob
from k3_accel.transport.staging import Slot, StagingRing
from k3_accel.transport.timing import Telemetry

log = logging.getLogger("k3_accel.transport")
# a propose's reply is awaited without sleeping this long (see Connection.wait); not on a host of
# 1-3 CPUs, where a spinning thread takes the core its peer needs
SPIN_S = 0.002 if (os.cpu_count() or 1) >= 4 else 0.0


class DraftClient:
    """The transport for one target (rank 0). Call :meth:`step` from one thread."""

    def __init__(self, settings: ClientSettings, device_ring: DeviceRing | None = None):
        self.settings = settings
        self.telemetry = Telemetry(settings.timing_log_interval)
        self.book = RequestBook(self.telemetry)
        self.ring = StagingRing(max(settings.ring_depth, 1), settings.max_rows, settings.context_width,
                                settings.hidden_dtype)
        self.plane = DevicePlane.create(settings.device_plane, self.ring.depth, settings.max_rows,
                                        settings.context_width, settings.hidden_dtype, settings.device, device_ring)
        self.link = Link(settings, self.telemetry, on_ready=self._on_ready, on_state_lost=self._on_state_lost,
                         on_lost=self._on_lost)
        self.sender = Sender(settings.heartbeat_ms / 1000, self._heartbeat)
        self.outbox = Outbox(settings, self.link, self.ring, self.book, self.sender, self.telemetry)
        self._capture = (CaptureWriter(settings.capture_dir, self._on_capture_error)
                         if settings.capture_dir else None)
        self.replies = ReplyReader(settings.address, settings.target_vocab_size, self.book.failures,
                                   self.telemetry)

    # ================================================================ lifecycle
    @property
    def state(self) -> State:
        return self.link.state

    @property
    def caps(self) -> p.Caps | None:
        return self.link.caps

    @property
    def ships_hidden(self) -> bool:
        return bool(self.caps is not None and self.caps.needs_hidden_states)

    def start(self, wait_s: float | None = None) -> "DraftClient":
        """Connect and say hello, waiting up to ``wait_s`` (default: the timeout) for the
        answer; the hello goes on in later steps if it takes longer. Never raises on failure."""
        wait_s = self.settings.timeout_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        self.link.start(wait_s)
        try:
            while self.plane.state == "pending" and self.link.ready and time.monotonic() < deadline:
                self.link.conn.poll(min(0.05, max(0.0, deadline - time.monotonic())))   # the attach's reply
        except TransportError as exc:
            self.link.lose(exc)
        return self

    def close(self) -> None:
        """Free everything this client holds on the server, stop the threads, drop the socket.
        Idempotent; bounded in time whatever the server does."""
        if self.link.state is State.CLOSED:
            return
        self.sender.close(self.settings.timeout_s)
        if self.link.ready:
            self.link.goodbye()
        if self._capture is not None:
            self._capture.flush(self.settings.timeout_s)
            self._capture.close()
        self.link.close()

    def __enter__(self) -> "DraftClient":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ===================================================================== step
    def step(self, inp: StepInput, while_waiting: Callable[[], None] | None = None) -> StepOutput:
        """Ship one step's context and, if asked, return drafts (see the module docstring);
        ``while_waiting()`` runs once a propose is sent, before its reply is waited for (must not raise)."""
        started = time.perf_counter()
        inp.validate(self.settings)
        if self.caps is not None and inp.k > self.caps.max_spec_tokens:
            raise StepInputError(f"k={inp.k} exceeds the server's max_spec_tokens={self.caps.max_spec_tokens}")
        drafts = np.full((inp.num_requests, inp.k), -1, dtype=np.int64)
        out = StepOutput(torch.from_numpy(drafts))
        if self.link.state not in (State.INCOMPATIBLE, State.CLOSED, State.NEW):
            live = self._guarded(inp, out, while_waiting)
            if self.book.apply() or live is None or not live.all():
                self._mask(inp, drafts)
        if inp.num_accepted is not None:
            self.telemetry.count("accepted_drafts", int(sum(inp.num_accepted)))
        self.telemetry.add("step", time.perf_counter() - started)
        self.telemetry.end_step()
        return out

    def _on_lost(self) -> None:
        """The socket is gone: a sender failure on it is old news, not a reason to drop the next link."""
        self.sender.broken = None
        self.plane.lost()

    def _guarded(self, inp: StepInput, out: StepOutput, while_waiting: Callable[[], None] | None) -> np.ndarray | None:
        """Run the step; transport trouble fails the step's batch closed instead of raising.
        Returns which requests were live when the step began (None: not known)."""
        try:
            if self.sender.broken is not None:
                exc, self.sender.broken = self.sender.broken, None
                raise TransportError(f"sender thread: {exc}")
            if not self.link.ready:
                self.link.service()
                self.book.apply()
            if self.link.ready:
                return self._run_step(inp, out, while_waiting)
            self._lost_rows(inp)
        except RingTimeout as exc:
            self.book.failures.push(FailureKind.RING_TIMEOUT, inp.batch_ids(), str(exc))
        except TransportError as exc:
            self.book.failures.push(FailureKind.TRANSPORT, inp.batch_ids(), str(exc))
            self.link.lose(exc)
        return None

    @property
    def down(self) -> bool:
        """No server to talk to now (any thread may ask): see :attr:`Link.down`."""
        return self.link.down

    def skip_step(self, req_ids: list[str]) -> None:
        """A step whose rows were not even gathered because the link is down: keep the link
        moving, and mark the requests so they draft again, with their history, once it is back."""
        try:
            self.link.service()
        except TransportError as exc:
            self.link.lose(exc)
        if req_ids and self.link.state is not State.READY:
            self.book.resolve(req_ids)
            self.book.failures.push(FailureKind.NOT_CONNECTED, req_ids, f"connection {self.link.state.value}")
        self.book.apply()
        self.telemetry.count("link_down_steps")

    def _lost_rows(self, inp: StepInput) -> None:
        """Not connected: rows of this step cannot reach the server, so their requests stop drafting
        (known from now on, even new ones: they draft again, with their history, once it is back)."""
        ids = [rid for rid, c in zip(inp.req_ids, inp.counts) if c > 0]
        if ids:
            self.book.resolve(ids)
            self.book.failures.push(FailureKind.NOT_CONNECTED, ids, f"connection {self.link.state.value}")

    def _run_step(self, inp: StepInput, out: StepOutput, while_waiting: Callable[[], None] | None) -> np.ndarray:
        recs = self.book.resolve(inp.req_ids)
        n = len(recs)
        counts = np.fromiter(inp.counts, dtype=np.int64, count=n)
        live = np.fromiter((r.disabled is None for r in recs), dtype=bool, count=n)
        want = live & np.fromiter(inp.sampled, dtype=bool, count=n) if inp.k > 0 else np.zeros(n, bool)
        ingest, propose = np.flatnonzero(live & ~want & (counts > 0)), np.flatnonzero(want)
        if ingest.size == 0 and propose.size == 0:
            self.link.service()
            return live
        anchor_tokens, anchor_positions = inp.anchors()
        plan = attach.starts(inp, recs, layout.plan_rows(counts, anchor_positions, ingest, propose),
                             self.book, self._send_in_order, self.telemetry)
        deferred = plan.propose.size == 0 and self.settings.ring_depth > 0
        t0 = time.perf_counter()
        if not deferred and not self.sender.wait_idle(self.settings.timeout_s):
            raise TransportError("deferred ingests not sent within the timeout")
        slot, event, device = self._stage(inp, plan, deferred)
        handles = np.empty(n, dtype=np.int64)
        ends = (plan.starts + counts).tolist()
        for i in plan.order.tolist():
            rec = recs[i]
            rec.length, rec.sent, handles[i] = ends[i], True, rec.handle
        if deferred:
            self.outbox.defer(inp, plan, slot, event, handles, device)
            out.deferred = True
            self.telemetry.add("enqueue", time.perf_counter() - t0)
            return live
        if event is not None:
            with self.telemetry.phase("d2h"):
                event.synchronize()
        pending = self.outbox.post_step(inp, plan, slot, handles, anchor_tokens, device)
        self.telemetry.add("enqueue", time.perf_counter() - t0)
        if pending is not None and while_waiting is not None:
            while_waiting()
        self._finish_step(inp, out, plan, pending)
        return live

    # -------------------------------------------------------------- staging
    def _stage(self, inp: StepInput, plan: layout.RowPlan, deferred: bool):
        t0 = time.perf_counter()
        slot, waited = self.ring.acquire(time.monotonic() + self.settings.timeout_s, self._progress)
        if waited:
            self.telemetry.count("ring_waits")
        t1 = time.perf_counter()
        want_hidden = inp.hidden is not None and (self.ships_hidden or self._capture is not None)
        if self.ships_hidden and inp.hidden is None and plan.total_rows:
            raise StepInputError(f"engine {self.caps.engine} needs hidden rows; StepInput.hidden is None")
        device = None            # the device plane: hidden rows GPU to GPU, tokens through the slot
        if want_hidden and self._capture is None and plan.total_rows and self.plane.usable(inp.hidden):
            device = self.plane.stage(inp.hidden, plan.counts, plan.starts,
                                      time.monotonic() + self.settings.timeout_s, self._progress)
        event = layout.stage(slot, plan.row_index(), plan.total_rows, inp.token_ids,
                             inp.hidden if want_hidden and device is None else None, private=deferred)
        self.telemetry.add("ring_wait", t1 - t0)
        self.telemetry.add("stage", time.perf_counter() - t1)
        if self._capture is not None:
            submit_step(self._capture, self.ring, inp, plan, slot, event, want_hidden, self.telemetry)
        return slot, event, device

    def _progress(self, slot: Slot, left: float) -> None:
        """Make a busy slot free up: read replies (or wait for the sender / capture thread)."""
        if self.link.conn.in_flight:
            self.link.conn.poll(min(left, 0.05))
            self.link.conn.expire()
        else:
            self.ring.wait_change(min(left, 0.05))

    # ------------------------------------------------------------- replies
    def _finish_step(self, inp: StepInput, out: StepOutput, plan: layout.RowPlan, pending: Pending | None) -> None:
        if pending is None:                # an ingest-only step without deferral: wait for it
            if self.link.conn.in_flight:
                with self.telemetry.phase("wait"):
                    while self.link.conn.in_flight:
                        self.link.conn.poll(0.05)
                        self.link.conn.expire()
                self.telemetry.count("sync_ingests")
            return
        with self.telemetry.phase("wait"):
            try:
                reply = self.link.conn.wait(pending, spin_s=SPIN_S,
                                            give_up_at=time.monotonic() + self.settings.propose_timeout_s)
            except ReplyLate:              # the step goes on without drafts; the context is intact
                self.telemetry.count("late_proposals")
                return
        self.telemetry.add("round_trip", pending.round_trip)
        if isinstance(reply.result, list) and len(reply.result) == 2:
            self.telemetry.add("server.store", reply.result[0])
            self.telemetry.add("server.engine", reply.result[1])
        self.replies.fill(inp, out, plan.propose, reply)

    def _mask(self, inp: StepInput, drafts: np.ndarray) -> None:
        """-1 for every request that is disabled (or unknown) now."""
        if not drafts.size:
            return
        records = self.book.records
        disabled = [i for i, rid in enumerate(inp.req_ids)
                    if (r := records.get(rid)) is None or r.disabled is not None]
        if disabled:
            drafts[disabled] = -1

    # ============================================================ requests
    def finish(self, req_ids: Iterable[str]) -> None:
        """Requests left the batch: free them remotely (kept for reattaches: ``RequestBook.finish``)."""
        ids = list(req_ids)
        if self._capture is not None:
            for rid in ids:
                self._capture.finish(rid)
        retain, drop = self.book.finish(ids)
        for handles, keep in ((retain, True), (drop, False)):
            if handles:
                self._free(handles, keep)

    def _send_in_order(self, msg, ids: list[str], kind: FailureKind, *frames) -> None:
        """A plain message that must not overtake the deferred ingests queued before it (a
        reconnect to rows still on their way): behind them on the sender thread, else at once."""
        if self.sender.idle:
            self.outbox.send_plain(msg, ids, kind, *frames)
        else:
            self.sender.submit(SendJob(lambda: self.outbox.send_plain(msg, ids, kind, *frames)))

    def _free(self, handles: list[int], retain: bool, queued: bool = False) -> None:
        if not self.link.ready:
            self.book.hold_frees(handles, retain)
            return
        if not queued and not self.sender.idle:   # after the deferred ingests queued before it, never
            self.sender.submit(SendJob(lambda: self._free(handles, retain, True)))   # ahead of their rows
            return
        try:          # lost with the link (queued behind rows a stalled server never read): sent again
            self.outbox.send_plain(p.Free(handles, retain), lost=lambda: self.book.hold_frees(handles, retain))
            self.telemetry.count_async("free_messages")
        except TransportError as exc:
            self.book.hold_frees(handles, retain)
            if queued:
                raise                          # the sender thread: the next step drops the link
            self.link.lose(exc)

    def wants_history(self) -> frozenset[str]:
        """Requests drafting again whose next step must carry their token history (any thread)."""
        return self.book.history_wanted

    def is_disabled(self, req_id: str) -> bool:
        return self.book.is_disabled(req_id)

    # ============================================================ callbacks
    def _on_ready(self, caps: p.Caps) -> None:
        # an idle link sends a ping within 1.5 heartbeats (the sender checks every half): keep that
        # well inside the lease the server advertises (a heartbeat of 2 s against a 3 s lease
        # let the server reclaim an idle, live client on a loaded machine)
        beat = self.settings.heartbeat_ms / 1000
        self.sender.heartbeat_s = min(beat, caps.lease_s / 4) if caps.lease_s > 0 else beat
        self.book.limit = caps.max_requests
        self.book.apply()
        self.book.rearm()
        for handles, retain in self.book.take_unsent_frees():
            self._free(handles, retain)
        self.plane.offer(caps, self.link.conn.send)

    def _on_state_lost(self, why: str) -> None:
        self.plane.lost()
        self.book.failures.push(FailureKind.SERVER_RESTART, detail=why, all_requests=True)
        self.book.server_state_lost()

    def _on_capture_error(self, detail: str) -> None:
        self.book.failures.push(FailureKind.CAPTURE, detail=detail)

    def _heartbeat(self) -> None:
        conn = self.link.conn
        if self.link.ready and time.monotonic() - conn.last_send > self.sender.heartbeat_s:
            conn.post(conn.encode(p.Ping(), expects_reply=False))
            self.telemetry.count_async("heartbeats")

    # ============================================================ inspection
    def server_stats(self) -> dict[str, Any]:
        """The server's ``stats`` (synchronous; raises :class:`TransportError` if not connected)."""
        if not self.link.ready:
            raise TransportError(f"not connected ({self.link.state.value})")
        return self.link.conn.wait(self.link.conn.send(p.Stats())).raise_for_error().result or {}

    def flush(self) -> None:
        """Wait until every deferred ingest is sent and every reply in flight is read (tests, shutdown)."""
        self.sender.wait_idle(self.settings.timeout_s)
        try:
            while self.link.conn.in_flight and self.link.conn.is_open:
                self.link.service()
                self.link.conn.poll(0.01)
        except TransportError as exc:          # a reply that will never come (the server died): as in a step,
            self.link.lose(exc)                # the link is dropped and its requests fail closed, nothing raises
        if self._capture is not None:
            self._capture.flush(self.settings.timeout_s)
        self.book.apply()

    def stats(self) -> dict[str, Any]:
        """A snapshot: state, ring, requests, counters and phase timings."""
        snap = self.telemetry.snapshot()
        snap.update({
            "state": self.link.state.value, "server_id": self.link.conn.server_id,
            "engine": self.caps.engine if self.caps else None, "in_flight": self.link.conn.in_flight,
            "incompatible": self.link.problem,
            "ring": {"depth": self.ring.depth, "pinned": self.ring.pinned, "bytes": self.ring.nbytes,
                     "deferral": self.settings.ring_depth > 0},
            "requests": self.book.stats(), "device_plane": self.plane.stats(),
            "capture": None if self._capture is None else
            {"records": self._capture.records, "errors": self._capture.errors},
        })
        return snap
