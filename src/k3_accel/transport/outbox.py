"""Turning a step's staged rows into messages on the wire, and settling their replies.

One step's rows go out as an ``ingest`` (requests that only ship rows) and
a ``propose`` (requests that want drafts), each cut into several messages
when it would exceed the server's message limit (a request's rows may span
messages; the propose is always last). Every message that views a staging
slot holds the slot until its reply. Replies are settled on the step thread
when read: whole-message errors and per-request failures become queued
failures of the requests they name.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode
from k3_accel.transport import layout
from k3_accel.transport.api import ClientSettings, StepInput
from k3_accel.transport.book import RequestBook
from k3_accel.transport.connection import Pending
from k3_accel.transport.device_plane import DeviceRows
from k3_accel.transport.failures import FailureKind
from k3_accel.transport.link import Link
from k3_accel.transport.sender import Sender, SendJob
from k3_accel.transport.staging import Slot, StagingRing
from k3_accel.transport.timing import Telemetry

_HEADER_ROOM = 1 << 16        # bytes kept free in a message for its header and meta frame


class Outbox:
    def __init__(self, settings: ClientSettings, link: Link, ring: StagingRing, book: RequestBook,
                 sender: Sender, telemetry: Telemetry):
        self.settings, self.link, self.ring, self.book = settings, link, ring, book
        self.sender, self.telemetry = sender, telemetry

    @property
    def ships_hidden(self) -> bool:
        caps = self.link.caps
        return bool(caps is not None and caps.needs_hidden_states)

    def _max_rows(self, device: DeviceRows | None = None) -> int:
        width = self.settings.context_width if self.ships_hidden and device is None else 0
        row_bytes = 8 + width * self.settings.hidden_dtype.itemsize
        return max(1, (self.link.caps.max_message_bytes - _HEADER_ROOM) // row_bytes)

    def _row_message(self, slot: Slot, group: np.ndarray, part: layout.Part, req_ids: Sequence[str],
                     handles: np.ndarray, anchor_tokens: np.ndarray | None = None, k: int = 0,
                     device: DeviceRows | None = None, sampling: tuple | None = None):
        """(message, frames, ids) of one part of a group; on the device plane (``device``) the
        hidden rows stay in the device slot and ``meta`` names each request's first slot row."""
        reqs = group[part.index] if len(part.index) != len(group) else group
        rows = part.hi - part.lo
        hidden = self.ships_hidden and rows > 0
        on_device = hidden and device is not None
        meta = np.empty((len(reqs), (3 if anchor_tokens is None else 4) + on_device), dtype=np.int64)
        meta[:, 0], meta[:, 1], meta[:, 2] = handles[reqs], part.starts, part.counts
        if anchor_tokens is not None:
            meta[:, 3] = anchor_tokens[reqs]
        if on_device:
            meta[:, -1] = device.meta_column(reqs, part.starts)
        frames = [meta.data, slot.token_ids.numpy()[part.lo:part.hi].data]
        ids = [req_ids[i] for i in reqs.tolist()]
        kw = {"hidden": p.dtype_name(self.settings.hidden_dtype), "width": self.settings.context_width} \
            if hidden else {}
        if on_device:
            kw["slot"] = device.slot
        elif hidden:
            frames.append(p.tensor_frame(slot.hidden[part.lo:part.hi]))
        if anchor_tokens is None:
            return p.Ingest(len(reqs), rows, **kw), frames, ids
        s = self.settings
        if sampling is not None:                   # (temperature, seeds) of the step's requests
            frames += [sampling[0][reqs].data, sampling[1][reqs].data]
            kw["sampling"] = True
        return p.Propose(k, len(reqs), rows, logits=s.logits, topk=s.topk if s.logits == "topk" else 0,
                         **kw), frames, ids

    def _messages(self, req_ids: Sequence[str], k: int, plan: layout.RowPlan, slot: Slot,
                  handles: np.ndarray, anchor_tokens: np.ndarray | None, device: DeviceRows | None = None,
                  sampling: tuple | None = None):
        """Every message of the step in send order; the last is the propose when there is one."""
        max_rows = self._max_rows(device)
        out = []
        if plan.ingest.size:
            out = [self._row_message(slot, plan.ingest, part, req_ids, handles, device=device)
                   for part in layout.split(plan.starts[plan.ingest], plan.counts[plan.ingest], 0, max_rows)]
        if plan.propose.size:
            starts, counts, base = plan.starts[plan.propose], plan.counts[plan.propose], plan.ingest_rows
            if plan.total_rows - base <= max_rows:
                last = layout.Part(plan.propose, starts, counts, base, plan.total_rows)
            else:
                parts = layout.split(starts, counts, base, max_rows)
                out += [self._row_message(slot, plan.propose, part, req_ids, handles, device=device)
                        for part in parts[:-1]]
                last = layout.tail(starts, counts, base, parts[-1].lo)
            out.append(self._row_message(slot, plan.propose, last, req_ids, handles, anchor_tokens, k, device,
                                         sampling))
        return out

    @staticmethod
    def _split(messages: list, plan: layout.RowPlan) -> int:
        """Messages of a step that was cut to fit the server's message limit (0: not cut)."""
        return len(messages) if len(messages) > 1 + bool(plan.propose.size and plan.ingest.size) else 0

    def post_step(self, inp: StepInput, plan: layout.RowPlan, slot: Slot, handles: np.ndarray,
                  anchor_tokens: np.ndarray, device: DeviceRows | None = None) -> Pending | None:
        pending = None
        messages = self._messages(inp.req_ids, inp.k, plan, slot, handles, anchor_tokens, device,
                                  self._sampling(inp))
        if split := self._split(messages, plan):
            self.telemetry.count("split_messages", split)
        for msg, frames, ids in messages:
            pending = self._post_slot(slot, msg, frames, ids, device)
            self.telemetry.count("sync_proposals" if type(msg) is p.Propose else "ingest_messages")
        return pending if plan.propose.size else None

    def _sampling(self, inp: StepInput) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's (temperature float32, seeds int64) per request, when it samples and the
        server offers sampling; None: the drafts are greedy."""
        caps = self.link.caps
        if inp.temperature is None or not inp.k or caps is None or not caps.sampling:
            return None
        temps = np.asarray(inp.temperature, dtype=np.float32)      # host values (lists, numpy, CPU tensors)
        if not temps.any():
            return None
        return temps, np.asarray(inp.seeds, dtype=np.int64)

    def defer(self, inp: StepInput, plan: layout.RowPlan, slot: Slot, ready, handles: np.ndarray,
              device: DeviceRows | None = None) -> None:
        """Hand the step's rows to the sender thread: once ``ready`` (the copy's event) has
        completed it cuts them into messages and sends them; the step thread only queues the job."""
        req_ids = list(inp.req_ids)               # the adapter may reuse its list after the step
        self.ring.hold(slot)                       # until every message holds it on its own
        if device is not None:
            device.ring.hold(device.slot)
        started = False

        def release() -> None:
            self.ring.release(slot)
            if device is not None:
                device.ring.release(device.slot)

        def build() -> None:
            nonlocal started
            started = True
            try:
                messages = self._messages(req_ids, 0, plan, slot, handles, None, device)
                if split := self._split(messages, plan):
                    self.telemetry.count_async("split_messages", split)
                for msg, frames, part_ids in messages:
                    self._post_slot(slot, msg, frames, part_ids, device)
                    self.telemetry.count_async("ingest_messages")
            finally:
                release()

        def failed(exc: Exception) -> None:
            if not started:                        # the copy never completed: nothing was sent
                self.ring.retire(slot)
                release()
            self.book.failures.push(FailureKind.SENDER, [req_ids[i] for i in plan.order.tolist()],
                                    f"deferred ingest: {exc}")

        self.sender.submit(SendJob(build, ready, failed))
        self.telemetry.count("deferred_ingests")

    def _post_slot(self, slot: Slot, msg, frames: list, ids: list[str], device: DeviceRows | None = None) -> Pending:
        """Send frames that view ``slot`` (and a message naming a device slot); the slots stay
        held until the reply."""
        named = device if device is not None and msg.slot >= 0 else None
        self.ring.hold(slot)
        if named is not None:
            named.ring.hold(named.slot)

        def release() -> None:
            self.ring.release(slot)
            if named is not None:
                named.ring.release(named.slot)

        def settle(item: Pending) -> None:
            release()
            self._settle(item, ids)

        def abandon(item: Pending, exc: Exception) -> None:
            release()
            self.ring.retire(slot)               # libzmq may still read it: fresh memory before reuse
            self.book.failures.push(FailureKind.TRANSPORT, ids, f"{item.op} seq={item.seq}: {exc}")

        conn = self.link.conn
        try:
            return conn.post(conn.encode(msg, *frames), on_reply=settle, on_abandon=abandon)
        except BaseException:
            release()
            raise

    def send_plain(self, msg, ids: list[str] = (), kind: FailureKind = FailureKind.REQUEST, *frames,
                   lost: Callable[[], None] | None = None) -> Pending:
        """Send a message that views no slot (frees, reconnects); settled when its reply is read.
        ``lost()``: the link went before its reply (the server may never have got it)."""
        def abandon(item: Pending, exc: Exception) -> None:
            if ids:
                self.book.failures.push(FailureKind.TRANSPORT, ids, f"{item.op} seq={item.seq}: {exc}")
            if lost is not None:
                lost()
        return self.link.conn.send(msg, *frames, keepalive=frames,
                                   on_reply=lambda item: self._settle(item, list(ids), kind), on_abandon=abandon)

    def _settle(self, item: Pending, ids: list[str], kind: FailureKind = FailureKind.REQUEST) -> None:
        """Account a reply; queue failures for whole-message or per-request errors."""
        reply = item.reply
        self.telemetry.add("reply_age", item.round_trip)
        if not reply.ok:
            code, message = reply.error or ("?", "")
            if code == ErrorCode.NO_SESSION.value:
                self.link.rehello("the server reclaimed this client's session")
            self.book.failures.push(FailureKind.MESSAGE if kind is FailureKind.REQUEST else kind, ids,
                                    f"{item.op}: {code}: {message}")
            return
        for i, code, message in reply.failures:
            if 0 <= i < len(ids):
                self.book.failures.push(kind, [ids[i]], f"{item.op}: {code}: {message}")

