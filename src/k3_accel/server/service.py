"""Op handlers: decoded requests of a session in, replies out. No sockets here.

Proposes of several sessions that wait at the same time run as one engine
batch (:meth:`DraftService.propose_batch`); each still gets its own reply,
and one request's failure stays its own.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np
import torch

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError, Reply
from k3_accel.server import rows as r
from k3_accel.server.device_plane import ServerDevicePlane
from k3_accel.server.engines.base import DraftEngine, EngineError, EngineFault, Proposal, ProposeBatch
from k3_accel.server.metrics import ServerMetrics
from k3_accel.server.reconnect import reconnect
from k3_accel.server.state import RequestError, RequestState, RequestStore, Session

log = logging.getLogger("k3_accel.server")
# a message handled slower than this is logged (op, seq, time; a propose also with its phases and what
# the engine last did): half of the 0.1 s a V2 target's GPU gives a step's drafts by default
SLOW_MESSAGE_S = 0.05
CLIENT_LABEL_CHARS = 128   # a hello label names its session in logs, /metrics and every client's stats

_FAULT_CODES = {EngineFault.CAPACITY: ErrorCode.CAPACITY, EngineFault.BAD_INPUT: ErrorCode.BAD_REQUEST,
                EngineFault.UNSUPPORTED: ErrorCode.UNSUPPORTED}


def new_server_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


@dataclass
class _Job:
    """One propose message inside a batch."""
    session: Session
    req: p.Request
    rows: r.RowMessage | None = None
    admitted: r.Admitted | None = None
    error: Reply | None = None
    started: float = 0.0
    store_s: float = 0.0
    engine_s: float = 0.0


class DraftService:
    def __init__(self, engine: DraftEngine, store: RequestStore, metrics: ServerMetrics, *,
                 max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES, lease_s: float = 0.0,
                 device_plane: ServerDevicePlane | None = None):
        self.engine, self.store, self.metrics = engine, store, metrics
        self.slow_s = SLOW_MESSAGE_S
        self.plane = device_plane if device_plane is not None else ServerDevicePlane.for_engine(engine)
        self.server_id = new_server_id()
        c = engine.caps
        self.caps = p.Caps(
            engine=c.kind, needs_hidden_states=c.needs_hidden_states, context_width=c.context_width,
            hidden_dtypes=list(c.hidden_dtypes), supports_logits=c.supports_logits,
            supports_topk=c.supports_topk, max_spec_tokens=c.max_spec_tokens, block_size=c.block_size,
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, aux_layer_ids=list(c.aux_layer_ids),
            mask_token_id=c.mask_token_id, max_requests=store.max_requests,
            max_requests_total=store.max_requests_total, max_message_bytes=max_message_bytes,
            pool_blocks=engine.pool.num_blocks,
            pool_bytes=engine.pool.num_blocks * engine.pool.block_rows * engine.bytes_per_row,
            lease_s=lease_s, fair_share=True, draft=dict(c.draft), confidence=c.confidence,
            sampling=c.sampling,
            device_plane=self.plane.offer)
        store.on_gave_back = lambda session, kind: metrics.gave_back(session.name, kind)
        self._handlers: dict[type, Callable] = {
            p.Ingest: self._ingest, p.Free: self._free, p.Clear: self._clear, p.Reconnect: self._reconnect,
            p.Ping: self._ping, p.Bye: self._bye, p.Stats: self._stats}

    # ------------------------------------------------------------------ entry
    def hello(self, req: p.Request, owner: str | None) -> tuple[Session | None, Reply]:
        """Open (or reclaim) the session the hello names; the reply carries the caps."""
        started = time.perf_counter()
        low, high = p.SESSION_KEY_CHARS
        if not low <= len(req.msg.session) <= high:
            return None, self._done(req, p.error_reply(req.seq, self.server_id, ErrorCode.BAD_FIELD,
                                                       f"hello.session: a secret of {low}..{high} characters"),
                                    started)
        if len(req.msg.client) > CLIENT_LABEL_CHARS or not req.msg.client.isprintable():
            return None, self._done(req, p.error_reply(req.seq, self.server_id, ErrorCode.BAD_FIELD,
                                                       f"hello.client: a label of at most {CLIENT_LABEL_CHARS} "
                                                       f"printable characters"), started)
        try:
            session = self.store.open_session(req.msg.session, req.msg.client, owner)
        except RequestError as exc:
            return None, self._done(req, p.error_reply(req.seq, self.server_id, exc.code, exc.message), started)
        shares = self.store.shares(session)
        caps = msgspec.structs.replace(self.caps, share_weight=session.weight, share_blocks=shares["share_blocks"],
                                       share_requests=shares["share_requests"])
        reply = Reply(req.seq, True, self.server_id, result=msgspec.to_builtins(caps))
        return session, self._done(req, reply, started)

    def attach(self, session: Session, conn: bytes, req: p.Request) -> Reply:
        """Open the target's device ring for this session and connection (the device plane)."""
        started = time.perf_counter()
        session.last_seen = time.monotonic()
        try:
            reply = self._ok(req, result=self.plane.attach(session.key, conn, req.msg))
        except ProtocolError as exc:
            reply = p.error_reply(req.seq, self.server_id, exc.code, exc.message)
        return self._done(req, reply, started)

    def handle(self, session: Session, req: p.Request) -> Reply:
        """Run one non-propose request; every failure becomes a typed error reply."""
        started = time.perf_counter()
        session.last_seen = time.monotonic()
        try:
            reply = self._handlers[type(req.msg)](session, req)
        except ProtocolError as exc:
            reply = p.error_reply(req.seq, self.server_id, exc.code, exc.message)
        except RequestError as exc:
            reply = p.error_reply(req.seq, self.server_id, exc.code, exc.message)
        except Exception as exc:  # an engine bug must not take the server down
            log.exception("internal error handling %s", req.op)
            reply = p.error_reply(req.seq, self.server_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return self._done(req, reply, started)

    def reject(self, exc: ProtocolError) -> Reply:
        """The reply to a message that could not be accepted at all."""
        self.metrics.error(exc.code.value)
        return p.error_reply(exc.seq, self.server_id, exc.code, exc.message)

    def _done(self, req: p.Request, reply: Reply, started: float | None = None) -> Reply:
        seconds = 0.0 if started is None else time.perf_counter() - started
        self.metrics.message(req.op, seconds)
        if seconds > self.slow_s:          # the target's GPU path gives a step's drafts ~0.1 s: say why it waits
            phases = ""
            if isinstance(reply.result, list) and len(reply.result) == 2:     # a propose: [store s, engine s]
                phases = (f"; rows stored in {reply.result[0] * 1e3:.1f} ms, engine {reply.result[1] * 1e3:.1f} ms, "
                          f"engine last: {getattr(self.engine, 'stats', dict)()}")
            log.warning("%s (seq %d) took %.0f ms on this server (a first-use compile, a GC pause, another "
                        "client's work?)%s", req.op, req.seq, seconds * 1e3, phases)
        if not reply.ok:
            self.metrics.error(reply.error[0])
        for _, code, _ in reply.failures:
            self.metrics.error(code)
        return reply

    def _ok(self, req: p.Request, result: Any = None, failures: list | None = None,
            tensors: dict | None = None) -> Reply:
        return Reply(req.seq, True, self.server_id, None, failures or [], result, tensors or {})

    # ---------------------------------------------------------------- ingest
    def _ingest(self, session: Session, req: p.Request) -> Reply:
        rows = r.check_message(req, self.engine.caps)
        admitted = r.admit(self.store, session, rows)
        self._store_rows(rows, admitted)
        return self._ok(req, failures=_failures(admitted))

    def _store_rows(self, rows: r.RowMessage, admitted: r.Admitted) -> None:
        started = time.perf_counter()
        try:
            stored = r.apply(self.store, rows, admitted)
        except EngineError as exc:
            raise ProtocolError(_FAULT_CODES[exc.fault], str(exc)) from None
        self.metrics.rows(stored, time.perf_counter() - started)

    # --------------------------------------------------------------- propose
    def propose_batch(self, items: list[tuple[Session, p.Request]]) -> list[Reply]:
        """Proposes of one or more sessions as one engine batch; a reply per message, in order."""
        return self.start_batch(items).finish()

    def start_batch(self, items: list[tuple[Session, p.Request]]) -> "Batch":
        """Store the rows of every message and launch the engine; the device may still be
        working when this returns (:meth:`Batch.done`, :meth:`Batch.finish`)."""
        return self.launch([self.prepare(session, req) for session, req in items])

    def prepare(self, session: Session, req: p.Request) -> _Job:
        """Check, admit and store one propose's rows now; its drafts come with :meth:`launch`.
        Until then no other message's admission may evict what it admitted."""
        job = self._prepare(session, req)
        if job.admitted is not None:
            self.store.in_flight.append(job.admitted.states)
        return job

    def release(self, jobs: list[_Job]) -> None:
        """Prepared proposes launched now, or never (their session ended): what they admitted is
        no longer protected from eviction."""
        held = {id(job.admitted.states) for job in jobs if job.admitted is not None}
        self.store.in_flight[:] = [states for states in self.store.in_flight if id(states) not in held]

    def launch(self, jobs: list[_Job]) -> "Batch":
        """The engine over prepared proposes: one call per (k, logits, topk) among them."""
        self.release(jobs)
        live = [j for j in jobs if j.error is None and j.req.msg.k > 0 and j.admitted.index]
        by_k: dict[tuple, list[_Job]] = {}
        for job in live:
            m = job.req.msg
            by_k.setdefault((m.k, m.logits, m.topk), []).append(job)
        launched = []
        for (k, logits, topk), group in by_k.items():
            try:
                started = time.perf_counter()
                launched.append((group, self._run_engine(group, k, logits, topk), started))
            except Exception as exc:  # noqa: BLE001 - every message of the group fails, the server lives
                self._group_failed(group, exc)
        return Batch(self, jobs, launched)

    def _group_failed(self, group: list[_Job], exc: Exception) -> None:
        log.error("engine failure in a batch of %d message(s): %s", len(group), exc, exc_info=exc)
        for job in group:
            job.error = p.error_reply(job.req.seq, self.server_id, ErrorCode.INTERNAL,
                                      f"{type(exc).__name__}: {exc}")

    def _prepare(self, session: Session, req: p.Request) -> _Job:
        job = _Job(session, req, started=time.perf_counter())
        session.last_seen = time.monotonic()
        try:
            job.rows = r.check_message(req, self.engine.caps)
            job.admitted = r.admit(self.store, session, job.rows)
            self._store_rows(job.rows, job.admitted)
            job.store_s = time.perf_counter() - job.started
        except (ProtocolError, RequestError) as exc:
            job.error = p.error_reply(req.seq, self.server_id, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001
            log.exception("internal error storing propose rows")
            job.error = p.error_reply(req.seq, self.server_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return job

    def _run_engine(self, group: list[_Job], k: int, logits: str, topk: int) -> Proposal:
        states = [s for job in group for s in job.admitted.states]
        anchors = np.concatenate([job.rows.anchors[job.admitted.index] for job in group])
        temperature = seeds = None
        if any(job.rows.temperature is not None for job in group):    # greedy where a message has none
            pick = [(job.rows.temperature, job.rows.seeds, job.admitted.index) for job in group]
            temperature = torch.from_numpy(np.concatenate(
                [np.zeros(len(i), np.float32) if t is None else t[i] for t, _, i in pick]))
            seeds = torch.from_numpy(np.concatenate([np.zeros(len(i), np.int64) if s is None else s[i]
                                                     for _, s, i in pick]))
        return self.engine.propose(ProposeBatch(
            [s.engine_state for s in states], _Histories(states), torch.from_numpy(anchors),
            k, logits, topk, temperature, seeds))

    def _propose_reply(self, job: _Job, result: tuple[Proposal, int] | None) -> Reply:
        if job.error is not None:
            return self._done(job.req, job.error, job.started)
        msg, n = job.req.msg, job.rows.n
        drafts = np.full((n, msg.k), -1, dtype=np.int32)
        tensors = {"drafts": drafts}
        if result is not None:
            proposal, at = result
            span = slice(at, at + len(job.admitted.index))
            if len(job.admitted.index) == n:
                drafts[:] = proposal.tokens.numpy()[span]
            else:
                drafts[job.admitted.index] = proposal.tokens.numpy()[span]
            if msg.logits != "none":
                idx = torch.as_tensor(job.admitted.index, dtype=torch.long)
                tensors.update(_logit_tensors(msg, n, idx, proposal, span))
            if proposal.confidence is not None:      # 0 where a request got no draft
                confidence = np.zeros((n, msg.k), dtype=np.float32)
                confidence[job.admitted.index] = proposal.confidence.numpy()[span]
                tensors["confidence"] = confidence
        reply = self._ok(job.req, [job.store_s, job.engine_s], _failures(job.admitted), tensors)
        return self._done(job.req, reply, job.started)

    # ----------------------------------------------------------------- other
    def _free(self, session: Session, req: p.Request) -> Reply:
        self.store.free(session, req.msg.handles, req.msg.retain)
        return self._ok(req)

    def _clear(self, session: Session, req: p.Request) -> Reply:
        return self._ok(req, result={"released": self.store.clear(session)})

    def _bye(self, session: Session, req: p.Request) -> Reply:
        return self._ok(req, result={"released": self._close(session)})

    def _close(self, session: Session) -> int:
        self.plane.drop(session.key)             # its device ring is unmapped with it
        self.metrics.session_closed(session.name)
        return self.store.close_session(session)

    def _ping(self, session: Session, req: p.Request) -> Reply:
        return self._ok(req)

    def _reconnect(self, session: Session, req: p.Request) -> Reply:
        started = time.perf_counter()
        try:
            restored = reconnect(self.store, session, req.msg.handle, req.tokens)
        except EngineError as exc:
            raise ProtocolError(_FAULT_CODES[exc.fault], str(exc)) from None
        self.metrics.rows(len(req.tokens) - restored, time.perf_counter() - started)   # rebuilt from its tokens
        return self._ok(req, result={"restored": restored})

    def _stats(self, session: Session, req: p.Request) -> Reply:
        return self._ok(req, result={**self.metrics.snapshot(), **self.store.summary(),
                                     "session": session.name, "device_plane": self.plane.stats(),
                                     "threads": torch.get_num_threads()})

    def reclaim(self, session: Session, why: str) -> None:
        """Free a session whose client went away (lease expired)."""
        released = self._close(session)
        self.metrics.reclaimed(session.name)
        log.warning("session %s reclaimed (%s): %d active request(s) freed", session.name, why, released)


class Batch:
    """Launched engine work of one round of proposes and the replies it will give."""

    def __init__(self, service: DraftService, jobs: list[_Job], launched: list):
        self.service, self.jobs, self.launched = service, jobs, launched

    def done(self) -> bool:
        return all(proposal.done() for _, proposal, _ in self.launched)

    def finish(self) -> list[Reply]:
        """Wait for the device, then a reply per message, in the order given."""
        svc, results = self.service, {}
        for group, proposal, started in self.launched:
            try:
                proposal.wait()
            except Exception as exc:  # noqa: BLE001 - a device error fails this group only
                svc._group_failed(group, exc)
                continue
            seconds = time.perf_counter() - started
            rows = sum(len(job.admitted.index) for job in group)
            svc.metrics.engine_step(rows, seconds)
            svc.metrics.proposed(rows, int((proposal.tokens.numpy() >= 0).sum()))
            at = 0
            for job in group:
                results[id(job)] = (proposal, at)
                job.engine_s = seconds
                at += len(job.admitted.index)
        return [svc._propose_reply(job, results.get(id(job))) for job in self.jobs]


class _Histories(Sequence):
    """A propose's token histories, each read only when an engine asks for it (most never do)."""
    __slots__ = ("_states",)

    def __init__(self, states: list[RequestState]):
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [state.history for state in self._states[i]]
        return self._states[i].history


def _failures(admitted: r.Admitted) -> list:
    return [(i, code, message) for i, (code, message) in sorted(admitted.failures.items())]


def _logit_tensors(msg: p.Propose, n: int, idx: torch.Tensor, proposal: Proposal, span: slice) -> dict:
    if msg.logits == "full" and proposal.logits is not None:
        full = torch.zeros((n, *proposal.logits.shape[1:]), dtype=torch.bfloat16)
        full[idx] = proposal.logits[span].to(torch.bfloat16)
        return {"logits": full}
    if msg.logits == "topk" and proposal.topk_values is not None:
        shape = (n, *proposal.topk_values.shape[1:])
        values = torch.zeros(shape, dtype=torch.bfloat16)
        indices = torch.full(shape, -1, dtype=torch.int32)
        values[idx] = proposal.topk_values[span].to(torch.bfloat16)
        indices[idx] = proposal.topk_indices[span].to(torch.int32)
        return {"topk_values": values, "topk_indices": indices}
    return {}
