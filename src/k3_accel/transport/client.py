"""``DraftClient``: one target's connection to the draft server, driven once per step.

Per step (see :meth:`DraftClient.step`):

1. start copying the step's rows device -> the oldest free staging slot
   (waiting for it while a message still references it: back-pressure);
2. while the copy runs: settle what is already known (replies that
   arrived, overdue replies, queued failures: each disables its requests),
   decide reconnects / cold starts, encode the messages;
3. once the copy is done, send on the one ordered connection: preludes,
   then an ``ingest`` for requests that only ship context, then a
   ``propose`` for requests that sampled a token (when ``k > 0``);
4. with a propose, wait for its reply only; without one, return at once
   (deferred ingest) unless the ring depth is 0.

Failures never raise out of :meth:`step` (except :class:`StepInputError`
for an inconsistent input); they turn drafts into -1 and disable the
affected requests until they leave the batch.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from k3_accel import protocol as p
from k3_accel.protocol import Reply, ServerCaps
from k3_accel.transport import handshake, layout
from k3_accel.transport.api import ClientSettings, StepInput, StepOutput
from k3_accel.transport.capture import CaptureJob, CaptureWriter
from k3_accel.transport.connection import Connection, CurveKeys, Pending
from k3_accel.transport.failures import (FailureKind, FailureQueue, IncompatibleServer, RingTimeout,
                                         StepInputError, TransportError, TransportTimeout)
from k3_accel.transport.prefix import PrefixIndex, TokenHistory
from k3_accel.transport.staging import Slot, StagingRing
from k3_accel.transport.timing import Telemetry

log = logging.getLogger("k3_accel.transport")


class State(str, Enum):
    NEW = "new"                    # start() not called yet
    CONNECTING = "connecting"      # socket open, hello not answered yet
    READY = "ready"
    DISCONNECTED = "disconnected"  # waiting for the next reconnect attempt (backoff)
    INCOMPATIBLE = "incompatible"  # hello did not fit: fail closed for good
    CLOSED = "closed"


@dataclass(eq=False)
class RemoteRequest:
    """What the client knows about one request's remote context."""
    id: str
    length: int = 0                         # rows the server holds once everything sent is handled
    disabled: str | None = None             # why it gets no drafts (until it leaves the batch)
    history: TokenHistory = field(default_factory=TokenHistory)
    born: float = field(default_factory=time.monotonic)
    staged_once: bool = False               # rows of it were sent at least once
    indexed: bool = False                   # registered as a reconnect source


class DraftClient:
    """The transport for one target (rank 0). Not thread-safe: call from one thread."""

    def __init__(self, settings: ClientSettings):
        self.settings = settings
        self.telemetry = Telemetry(settings.timing_log_interval)
        self.failures = FailureQueue()
        self.caps: ServerCaps | None = None
        self.state = State.NEW
        self.ring = StagingRing(max(settings.ring_depth, 1), settings.max_rows, settings.context_width,
                                settings.hidden_dtype)
        self._requests: dict[str, RemoteRequest] = {}
        self._prefix: PrefixIndex | None = None
        self._conn = Connection(settings.address, settings.timeout_s, curve=self._curve(settings),
                                zero_copy_min_bytes=settings.zero_copy_min_bytes,
                                on_server_id=self._on_server_restart)
        self._hello: Pending | None = None
        self._connecting_since = 0.0
        self._backoff = settings.backoff_initial_ms / 1000
        self._next_attempt = 0.0
        self._unsent_frees: list[tuple[list[str], bool]] = []
        self._capture = (CaptureWriter(settings.capture_dir, self._on_capture_error)
                         if settings.capture_dir else None)

    @staticmethod
    def _curve(settings: ClientSettings) -> CurveKeys | None:
        if not settings.curve_server_key:
            return None
        return CurveKeys.load(settings.curve_server_key, settings.curve_client_key)

    # ================================================================ lifecycle
    def start(self) -> "DraftClient":
        """Connect and say hello (blocking, bounded by the timeout); never raises on failure."""
        if self.state is not State.NEW:
            raise RuntimeError(f"start() called in state {self.state.value}")
        self._conn.open()
        self.state, self._connecting_since = State.CONNECTING, time.monotonic()
        try:
            if not self._conn.writable(self.settings.timeout_s):
                raise TransportTimeout(f"draft server at {self.settings.address} not reachable")
            self._send_hello()
            self._accept_hello(self._conn.wait(self._hello))
        except TransportError as exc:
            log.error("k3 draft server not usable at start (%s); drafting stays off until it answers", exc)
            self._lose_connection(exc)
        return self

    def close(self) -> None:
        """Stop: flush capture, drop the socket. Idempotent."""
        if self.state is State.CLOSED:
            return
        if self._capture is not None:
            self._capture.flush(self.settings.timeout_s)
            self._capture.close()
        self._conn.close()
        self.state = State.CLOSED

    def __enter__(self) -> "DraftClient":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def ship_hidden(self) -> bool:
        return bool(self.caps is not None and self.caps.needs_hidden_states)

    # ================================================================== step
    def step(self, inp: StepInput) -> StepOutput:
        """Ship one step's context and, if asked, return drafts (see the module docstring)."""
        started = time.perf_counter()
        inp.validate(self.settings)
        if self.caps is not None and inp.k > self.caps.max_spec_tokens:
            raise StepInputError(f"k={inp.k} exceeds the server's max_spec_tokens={self.caps.max_spec_tokens}")
        out = StepOutput.empty(inp.num_requests, inp.k)
        if self.state not in (State.INCOMPATIBLE, State.CLOSED, State.NEW):
            self._guarded_step(inp, out)
            self._apply_failures()
            self._mask(inp, out)
        if inp.num_accepted is not None:
            self.telemetry.count("accepted_drafts", int(sum(inp.num_accepted)))
        self.telemetry.add("step", time.perf_counter() - started)
        self.telemetry.end_step()
        return out

    def _guarded_step(self, inp: StepInput, out: StepOutput) -> None:
        """Run the step; transport trouble fails the step's batch closed instead of raising."""
        try:
            if self.state is not State.READY:
                self._service()
                self._apply_failures()
            if self.state is State.READY:
                self._run_step(inp, out)
            else:
                self._lost_rows(inp)
        except RingTimeout as exc:
            self.failures.push(FailureKind.RING_TIMEOUT, self._batch_ids(inp), str(exc))
        except TransportError as exc:
            self.failures.push(FailureKind.TRANSPORT, self._batch_ids(inp), str(exc))
            self._lose_connection(exc)

    @staticmethod
    def _batch_ids(inp: StepInput) -> list[str]:
        return [rid for rid, c, s in zip(inp.req_ids, inp.counts, inp.sampled) if c > 0 or s]

    def _lost_rows(self, inp: StepInput) -> None:
        """Not connected: rows of this step cannot reach the server, so their requests stop drafting."""
        ids = [rid for rid, c in zip(inp.req_ids, inp.counts) if c > 0]
        if ids:
            self.failures.push(FailureKind.NOT_CONNECTED, ids, f"connection {self.state.value}")

    def _groups(self, inp: StepInput, reqs: list[RemoteRequest]) -> tuple[list[int], list[int]]:
        """``(ingest, propose)``: live requests that only ship rows / that want drafts."""
        live = [i for i, r in enumerate(reqs) if r.disabled is None]
        propose = [i for i in live if inp.sampled[i] and inp.k > 0]
        chosen = set(propose)
        return [i for i in live if i not in chosen and inp.counts[i] > 0], propose

    def _run_step(self, inp: StepInput, out: StepOutput) -> None:
        """Copy, then do every piece of CPU work that needs no row data while the copy runs."""
        reqs = [self._request(rid) for rid in inp.req_ids]
        ingest, propose = self._groups(inp, reqs)
        if not ingest and not propose:
            self._service()
            return
        anchors = self._anchor_lists(inp)
        plan, slot = self._stage(inp, ingest, propose)
        clock, t0 = time.perf_counter, time.perf_counter()
        self._service()                       # replies, overdue checks: overlaps the copy
        self._apply_failures()
        if self.state is not State.READY:
            self._lost_rows(inp)
            return
        starts = {i: anchors[1][i] - inp.counts[i] for i in plan.staged() if inp.counts[i] > 0}
        drop = self._prepare_new(inp, reqs, starts) | {i for i in plan.staged() if reqs[i].disabled}
        frames = None if drop else self._encode_step(slot, plan, inp, anchors)
        t1 = clock()
        layout.wait_for_copies(inp.positions, inp.token_ids, inp.hidden if plan.hidden else None)
        t2 = clock()
        self._check_starts(slot, plan, starts)
        if drop:
            plan = layout.compact(slot, plan, drop)
            frames = self._encode_step(slot, plan, inp, anchors)
        pending_ingest, pending_propose = self._post_step(slot, plan, inp, frames)
        self.telemetry.add("d2h", t2 - t1)
        self.telemetry.add("enqueue", (t1 - t0) + (clock() - t2))
        self._record(reqs, plan, slot, starts)
        self._finish_step(inp, out, plan, pending_ingest, pending_propose)

    # -------------------------------------------------------------- staging
    def _anchor_lists(self, inp: StepInput) -> tuple[list[int], list[int]]:
        """Anchors as Python lists (device tensors come over first, ahead of the rows)."""
        values = [inp.anchor_tokens, inp.anchor_positions]
        on_device = [isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values]
        if any(on_device):
            sources = [v for v, dev in zip(values, on_device) if dev]
            values = [v.to("cpu", non_blocking=True) if dev else v for v, dev in zip(values, on_device)]
            layout.wait_for_copies(*sources)
        return tuple(v.tolist() if isinstance(v, torch.Tensor) else list(v) for v in values)

    def _stage(self, inp: StepInput, ingest: list[int], propose: list[int]):
        """Wait for the oldest free slot and start the copies into it (not waiting for them)."""
        t0 = time.perf_counter()
        slot, waited = self.ring.acquire(time.monotonic() + self.settings.timeout_s, self._progress)
        if waited:
            self.telemetry.count("ring_waits")
        want_hidden = inp.hidden is not None and (self.ship_hidden or self._capture is not None)
        plan = layout.plan_rows(list(inp.counts), ingest, propose, hidden=want_hidden)
        if self.ship_hidden and inp.hidden is None and plan.total_rows:
            raise StepInputError(f"engine {self.caps.engine} needs hidden rows; StepInput.hidden is None")
        t1 = time.perf_counter()
        layout.stage(slot, plan, inp.positions, inp.token_ids, inp.hidden)
        self.telemetry.add("ring_wait", t1 - t0)
        self.telemetry.add("stage", time.perf_counter() - t1)
        return plan, slot

    def _check_starts(self, slot: Slot, plan: layout.RowPlan, starts: dict[int, int]) -> None:
        """The rows must start where the anchors say (anchor_position - count)."""
        if not starts:
            return
        idx = np.fromiter((plan.dst[i] for i in starts), dtype=np.int64, count=len(starts))
        want = np.fromiter(starts.values(), dtype=np.int64, count=len(starts))
        got = slot.positions.numpy()[idx]
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise StepInputError(f"request {list(starts)[bad]}: rows start at {int(got[bad])} but "
                                 f"anchor_position - count = {int(want[bad])}")

    def _progress(self, slot: Slot, left: float) -> None:
        """Make a busy slot free up: read replies (or wait for the capture thread)."""
        if self._conn.in_flight:
            self._conn.poll(min(left, 0.05))
            self._conn.expire()
        else:
            self.ring.wait_change(min(left, 0.05))

    # --------------------------------------------------------------- sending
    def _rows_tensors(self, slot: Slot, start: int, stop: int) -> dict[str, torch.Tensor]:
        tensors = {"positions": slot.positions[start:stop], "token_ids": slot.token_ids[start:stop]}
        if self.ship_hidden:
            tensors["hidden"] = slot.hidden[start:stop]
        return tensors

    def _encode_step(self, slot: Slot, plan: layout.RowPlan, inp: StepInput, anchors) -> tuple:
        """Encoded ingest and propose messages of the step (either may be None)."""
        ingest = propose = None
        if plan.ingest:
            msg = p.Ingest([p.RowSpan(inp.req_ids[i], inp.counts[i]) for i in plan.ingest])
            ingest = self._conn.encode(msg, self._rows_tensors(slot, 0, plan.ingest_rows))
        if plan.propose:
            tokens, positions = anchors
            items = [p.ProposeItem(inp.req_ids[i], inp.counts[i], int(tokens[i]), int(positions[i]))
                     for i in plan.propose]
            s = self.settings
            msg = p.Propose(inp.k, items, logits=s.logits, topk=s.topk if s.logits == "topk" else 0)
            start = plan.ingest_rows
            propose = self._conn.encode(msg, self._rows_tensors(slot, start, start + plan.propose_rows))
        return ingest, propose

    def _post_step(self, slot: Slot, plan: layout.RowPlan, inp: StepInput, frames: tuple):
        """Send the step's messages, ingest first; each holds the slot until its reply."""
        ingest, propose = frames
        pending_ingest = pending_propose = None
        if ingest is not None:
            pending_ingest = self._post_slot(slot, ingest, [inp.req_ids[i] for i in plan.ingest])
            self.telemetry.count("ingest_messages")
        if propose is not None:
            pending_propose = self._post_slot(slot, propose, [inp.req_ids[i] for i in plan.propose])
            self.telemetry.count("sync_proposals")
        return pending_ingest, pending_propose

    def _post_slot(self, slot: Slot, outgoing, ids: list[str]) -> Pending:
        """Send frames that view ``slot``; the slot stays held until the reply."""
        self.ring.hold(slot)
        try:
            return self._conn.post(outgoing, on_reply=self._slot_settler(slot, ids),
                                   on_abandon=self._slot_abandoner(slot, ids))
        except BaseException:
            self.ring.release(slot)
            raise

    def _slot_settler(self, slot: Slot, ids: list[str]):
        def settle(item: Pending) -> None:
            self.ring.release(slot)
            self._settle(item, ids)
        return settle

    def _slot_abandoner(self, slot: Slot, ids: list[str]):
        def abandon(item: Pending, exc: Exception) -> None:
            self.ring.release(slot)
            self.ring.retire(slot)          # libzmq may still read it: fresh memory before reuse
            self.failures.push(FailureKind.TRANSPORT, ids, f"{item.op} seq={item.seq}: {exc}")
        return abandon

    def _settle(self, item: Pending, ids: list[str], kind: FailureKind = FailureKind.REQUEST) -> None:
        """Account a reply; queue failures for whole-message or per-request errors."""
        reply = item.reply
        self.telemetry.add("reply_age", item.round_trip)
        self.telemetry.add_server_timing(reply.body.get("timing"))
        if not reply.ok:
            err = reply.error or {}
            self.failures.push(FailureKind.MESSAGE if kind is FailureKind.REQUEST else kind, ids,
                               f"{item.op}: {err.get('code')}: {err.get('message')}")
            return
        for result in reply.body.get("results", ()):
            if isinstance(result, dict) and not result.get("ok", False):
                self.failures.push(kind, [str(result.get("id"))],
                                   f"{item.op}: {result.get('code')}: {result.get('message')}")

    def _send_plain(self, msg, tensors=None, ids: Sequence[str] = (),
                    kind: FailureKind = FailureKind.REQUEST) -> Pending:
        """Send a message that views no slot (frees, preludes); its reply is settled when read."""
        def abandon(item: Pending, exc: Exception) -> None:
            if ids:
                self.failures.push(FailureKind.TRANSPORT, ids, f"{item.op} seq={item.seq}: {exc}")
        return self._conn.send(msg, tensors, keepalive=tensors,
                               on_reply=lambda item: self._settle(item, list(ids), kind), on_abandon=abandon)

    # -------------------------------------------- new requests, reconnect, gaps
    def _prepare_new(self, inp: StepInput, reqs: list[RemoteRequest], starts: dict[int, int]) -> set[int]:
        """Preludes for requests whose rows start past their remote context; returns those to drop."""
        drop, fills = set(), []
        for i, start in starts.items():
            req = reqs[i]
            if start <= req.length:
                continue
            if req.staged_once:
                self._disable_now(req, FailureKind.CLIENT_GAP,
                                  f"rows start at {start}, the server holds {req.length}")
                drop.add(i)
                continue
            fill = self._attach_prefix(req, start, (inp.prompt_token_ids or {}).get(req.id))
            if fill is None:
                drop.add(i)
            elif fill[1] > fill[0]:
                fills.append((req, *fill))
        if fills:
            self._send_fills(fills)
        return drop

    def _attach_prefix(self, req: RemoteRequest, start: int, prompt) -> tuple[int, int, np.ndarray] | None:
        """Reconnect ``req`` to a retained prefix; ``(fill_from, fill_to, prompt)`` or None (disabled)."""
        if prompt is None:
            self._disable_now(req, FailureKind.COLD_START,
                              f"prefix-cache hit at {start} but no prompt_token_ids to rebuild it")
            return None
        prompt = np.asarray(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt, dtype=np.int64)
        if len(prompt) < start:
            self._disable_now(req, FailureKind.COLD_START, f"prompt has {len(prompt)} tokens, rows start at {start}")
            return None
        match = self._prefix.lookup(prompt, start, exclude=req.id) if self._prefix else None
        length = match[1] if match else 0
        if length < start and self.ship_hidden:
            why = (f"reconnect covers {length} of {start} cached tokens" if match else
                   f"no retained prefix for {start} cached tokens")
            self._disable_now(req, FailureKind.COLD_START, f"{why}; hidden rows for the rest are gone")
            return None
        if match is not None:
            token_ids = torch.from_numpy(prompt[:length].copy())
            self._send_plain(p.Reconnect(match[0], req.id, length), {"token_ids": token_ids}, [req.id],
                             FailureKind.RECONNECT)
            self.telemetry.count("reconnects")
        if length < start:
            log.info("k3 draft: request %r cold-starts %d cached tokens from its prompt (%s)", req.id,
                     start - length, f"reconnected {length}" if match else "no retained prefix")
            self.telemetry.count("cold_starts")
        req.history.write(0, prompt[:start])
        req.length = start
        return length, start, prompt

    def _send_fills(self, fills: list) -> None:
        """One ingest of prompt tokens for cached positions the server must rebuild (no hidden rows)."""
        spans = [p.RowSpan(req.id, b - a) for req, a, b, _ in fills]
        positions = torch.cat([torch.arange(a, b, dtype=torch.int64) for _, a, b, _ in fills])
        token_ids = torch.from_numpy(np.concatenate([pr[a:b] for _, a, b, pr in fills]))
        self._send_plain(p.Ingest(spans), {"positions": positions, "token_ids": token_ids},
                         [req.id for req, *_ in fills])

    # ------------------------------------------------------------ bookkeeping
    def _record(self, reqs: list[RemoteRequest], plan: layout.RowPlan, slot: Slot,
                starts: dict[int, int]) -> None:
        """After sending: histories, remote lengths, prefix sources, capture jobs."""
        tokens = slot.token_ids.numpy()
        for i in plan.staged():
            req, n = reqs[i], plan.counts[i]
            req.staged_once = True
            if n == 0:
                continue
            d = plan.dst[i]
            req.history.write(starts[i], tokens[d:d + n])
            req.length = starts[i] + n
            if not req.indexed and self._prefix is not None and req.length >= self._prefix.block_size:
                self._prefix.track(req.id, req.history)
                req.indexed = True
            if self._capture is not None:
                self._submit_capture(slot, req.id, d, n, plan.hidden)

    def _submit_capture(self, slot: Slot, req_id: str, d: int, n: int, hidden: bool) -> None:
        self.ring.hold(slot)
        self._capture.submit(CaptureJob(req_id, slot.positions[d:d + n], slot.token_ids[d:d + n],
                                        slot.hidden[d:d + n] if hidden else None,
                                        release=lambda: self.ring.release(slot)))
        self.telemetry.count("capture_records")

    def _finish_step(self, inp: StepInput, out: StepOutput, plan: layout.RowPlan,
                     pending_ingest: Pending | None, pending_propose: Pending | None) -> None:
        """Wait for the propose (or, without deferral, the ingest); else return at once."""
        if pending_propose is not None:
            with self.telemetry.phase("wait"):
                reply = self._conn.wait(pending_propose)
            self.telemetry.add("round_trip", pending_propose.round_trip)
            self._fill(inp, out, plan, reply)
        elif pending_ingest is not None and self.settings.ring_depth == 0:
            with self.telemetry.phase("wait"):
                self._conn.wait(pending_ingest)
            self.telemetry.add("round_trip", pending_ingest.round_trip)
            self.telemetry.count("sync_ingests")
        elif pending_ingest is not None:
            out.deferred = True
            self.telemetry.count("deferred_ingests")

    def _fill(self, inp: StepInput, out: StepOutput, plan: layout.RowPlan, reply: Reply) -> None:
        if not reply.ok or "drafts" not in reply.tensors:
            return
        rows = torch.tensor(plan.propose, dtype=torch.long)
        drafts = reply.tensors["drafts"]
        if tuple(drafts.shape) != (len(plan.propose), inp.k):
            self.failures.push(FailureKind.MESSAGE, [inp.req_ids[i] for i in plan.propose],
                               f"drafts shape {list(drafts.shape)} != [{len(plan.propose)}, {inp.k}]")
            return
        out.drafts[rows] = drafts
        for name, t in reply.tensors.items():
            if name != "drafts":
                self._place_extra(out, name, t, rows, inp.num_requests)

    @staticmethod
    def _place_extra(out: StepOutput, name: str, t: torch.Tensor, rows: torch.Tensor, r: int) -> None:
        if t.shape[0] == r and torch.equal(rows, torch.arange(r)):
            full = t
        else:
            full = torch.zeros((r, *t.shape[1:]), dtype=t.dtype)
            full[rows] = t
        if name == "logits":
            out.logits = full
        else:
            out.extra[name] = full

    # ============================================================ requests
    def _request(self, req_id: str) -> RemoteRequest:
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = RemoteRequest(req_id)
        return req

    def finish(self, req_ids: Iterable[str]) -> None:
        """Requests left the batch: free them remotely (retaining healthy ones) and forget them."""
        retain, drop = [], []
        for rid in req_ids:
            req = self._requests.pop(rid, None)
            if self._capture is not None:
                self._capture.finish(rid)
            if req is None:
                continue
            healthy = req.disabled is None and req.length > 0
            (retain if healthy else drop).append(rid)
            if self._prefix is not None:
                self._prefix.retain(rid) if healthy else self._prefix.forget(rid)
        for ids, keep in ((retain, True), (drop, False)):
            if ids:
                self._free(ids, keep)

    def _free(self, ids: list[str], retain: bool) -> None:
        if self.state is not State.READY:
            self._unsent_frees.append((ids, retain))
            del self._unsent_frees[:-64]
            return
        try:
            self._send_plain(p.Free(ids, retain))
            self.telemetry.count("free_messages")
        except TransportError as exc:
            self._unsent_frees.append((ids, retain))
            self._lose_connection(exc)

    def _mask(self, inp: StepInput, out: StepOutput) -> None:
        disabled = [i for i, rid in enumerate(inp.req_ids)
                    if (r := self._requests.get(rid)) is None or r.disabled is not None]
        if disabled and out.drafts.numel():
            out.drafts[disabled] = -1

    def _disable_now(self, req: RemoteRequest, kind: FailureKind, detail: str) -> None:
        """Queue a failure for ``req``; it is disabled when the step drains the queue."""
        self.failures.push(kind, [req.id], detail)

    _QUIET = (FailureKind.REQUEST, FailureKind.COLD_START, FailureKind.RECONNECT,
              FailureKind.CLIENT_GAP, FailureKind.NOT_CONNECTED)

    def _apply_failures(self) -> None:
        """Drain the failure queue at once and disable every affected request."""
        for failure in self.failures.drain():
            self.telemetry.count(f"failures.{failure.kind.value}")
            if failure.kind is FailureKind.CAPTURE:
                continue
            if failure.all_requests:
                targets = [r for r in self._requests.values() if r.born <= failure.at]
            else:
                targets = [self._requests[i] for i in failure.ids if i in self._requests]
            newly = [r for r in targets if r.disabled is None]
            for req in newly:
                req.disabled = f"{failure.kind.value}: {failure.detail}"
                if self._prefix is not None:
                    self._prefix.forget(req.id)
            self.telemetry.count("disabled_requests", len(newly))
            if newly:
                level = logging.INFO if failure.kind in self._QUIET else logging.WARNING
                log.log(level, "k3 draft: %s failure disables %d request(s) (%s): %s", failure.kind.value,
                        len(newly), ", ".join(r.id for r in newly[:4]) + ("..." if len(newly) > 4 else ""),
                        failure.detail)

    # ========================================================== connection
    def _service(self) -> None:
        """Advance the connection: reconnect attempts, replies, overdue checks."""
        now = time.monotonic()
        if self.state is State.DISCONNECTED and now >= self._next_attempt:
            self._conn.open()
            self.state, self._connecting_since, self._hello = State.CONNECTING, now, None
        if self.state is State.CONNECTING and self._hello is None:
            if self._conn.writable(0):
                self._send_hello()
            elif now - self._connecting_since > self.settings.timeout_s:
                raise TransportTimeout(f"draft server at {self.settings.address} not reachable")
        self._conn.poll(0)
        self._conn.expire()
        if self.state is State.CONNECTING and self._hello is not None and self._hello.done:
            self._accept_hello(self._hello.reply)

    def _send_hello(self) -> None:
        self._hello = self._conn.send(p.Hello(client=self.settings.client_name))

    def _accept_hello(self, reply: Reply) -> None:
        s = self.settings
        needs = handshake.TargetNeeds(s.context_width, s.hidden_dtype, s.num_speculative_tokens, s.logits, s.topk)
        try:
            self.caps = handshake.check(reply, needs)
        except IncompatibleServer as exc:
            self._fail_closed(exc)
            return
        if self._prefix is None or self._prefix.block_size != self.caps.block_size:
            self._prefix = PrefixIndex(self.caps.block_size, s.max_retained)
        self.state, self._backoff = State.READY, s.backoff_initial_ms / 1000
        log.info("k3 draft server %s ready: engine=%s server_id=%s hidden=%s width=%d max_k=%d",
                 s.address, self.caps.engine, reply.server_id, self.caps.needs_hidden_states,
                 self.caps.context_width, self.caps.max_spec_tokens)
        frees, self._unsent_frees = self._unsent_frees, []
        for ids, retain in frees:
            self._free(ids, retain)

    def _fail_closed(self, exc: Exception) -> None:
        log.error("k3 draft server at %s does not fit this target, drafting is OFF: %s",
                  self.settings.address, exc)
        self.telemetry.count("incompatible")
        self._conn.abandon(exc)
        self.state = State.INCOMPATIBLE
        self.failures.push(FailureKind.MESSAGE, detail=f"incompatible server: {exc}", all_requests=True)
        self._apply_failures()

    def _lose_connection(self, exc: Exception) -> None:
        """Drop the socket after a transport error; reconnect later with backoff."""
        was_ready = self.state is State.READY
        self._conn.abandon(exc)
        self._hello = None
        if self.state in (State.INCOMPATIBLE, State.CLOSED):
            return
        if was_ready:
            log.warning("k3 draft transport error, reconnecting: %s", exc)
            self._backoff = self.settings.backoff_initial_ms / 1000
            self._next_attempt = time.monotonic()
        else:
            self._next_attempt = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.settings.backoff_max_ms / 1000)
        self.telemetry.count("transport_errors")
        self.state = State.DISCONNECTED

    def _on_server_restart(self, old: str, new: str) -> None:
        log.warning("k3 draft server restarted (server_id %s -> %s): all remote state is gone", old, new)
        self.telemetry.count("server_restarts")
        self.failures.push(FailureKind.SERVER_RESTART, detail=f"{old} -> {new}", all_requests=True)
        if self._prefix is not None:
            self._prefix.clear()

    def _on_capture_error(self, detail: str) -> None:
        self.failures.push(FailureKind.CAPTURE, detail=detail)

    # ============================================================ inspection
    def server_stats(self) -> dict[str, Any]:
        """The server's ``stats`` (synchronous; raises :class:`TransportError` if not connected)."""
        if self.state is not State.READY:
            raise TransportError(f"not connected ({self.state.value})")
        return self._conn.wait(self._conn.send(p.Stats())).raise_for_error().body.get("stats", {})

    def flush(self) -> None:
        """Wait for every reply in flight and for the capture thread (tests, shutdown)."""
        while self._conn.in_flight:
            self._service()
            self._conn.poll(0.01)
        if self._capture is not None:
            self._capture.flush(self.settings.timeout_s)
        self._apply_failures()

    def is_disabled(self, req_id: str) -> bool:
        req = self._requests.get(req_id)
        return req is not None and req.disabled is not None

    def stats(self) -> dict[str, Any]:
        """A snapshot: state, ring, requests, counters and phase timings."""
        snap = self.telemetry.snapshot()
        snap.update({
            "state": self.state.value, "server_id": self._conn.server_id,
            "engine": self.caps.engine if self.caps else None, "in_flight": self._conn.in_flight,
            "ring": {"depth": self.ring.depth, "pinned": self.ring.pinned, "bytes": self.ring.nbytes,
                     "deferral": self.settings.ring_depth > 0},
            "requests": {"tracked": len(self._requests),
                         "disabled": sum(r.disabled is not None for r in self._requests.values()),
                         "prefix_sources": len(self._prefix) if self._prefix else 0},
            "capture": None if self._capture is None else
            {"records": self._capture.records, "errors": self._capture.errors},
        })
        return snap

