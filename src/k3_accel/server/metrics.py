"""Server counters: Prometheus metrics plus a plain snapshot for the ``stats`` op.

The hot path only appends to plain Python counters and a list of pending
observations (under one uncontended lock); :meth:`ServerMetrics.flush` moves
them into the Prometheus objects, when ``/metrics`` is scraped and during the
loop's housekeeping. Prometheus calls cost microseconds each, a message has
about ten of them, and a propose round trip is budgeted in tens of microseconds.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from prometheus_client import CollectorRegistry, Counter as PCounter, Gauge, Histogram

MAX_SESSION_LABELS = 32      # per-session series beyond this many sessions go to "other"
_STEP_BUCKETS = (1e-4, 3e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._messages = PCounter("k3_draft_messages", "Messages handled, by op", ["op"], registry=r)
        self._rows = PCounter("k3_draft_ingested_rows", "Context rows stored", registry=r)
        self._proposals = PCounter("k3_draft_proposals", "Requests drafted for", registry=r)
        self._tokens = PCounter("k3_draft_tokens_proposed", "Draft tokens returned (not -1)", registry=r)
        self._errors = PCounter("k3_draft_errors", "Errors returned, by code", ["code"], registry=r)
        self._latency = Histogram("k3_draft_latency_seconds", "Handling time by op", ["op"], registry=r,
                                  buckets=_STEP_BUCKETS)
        self._engine = Histogram("k3_draft_engine_step_seconds", "Engine time per propose batch",
                                 registry=r, buckets=_STEP_BUCKETS)
        self._ingest = Histogram("k3_draft_ingest_seconds", "Engine time per stored row message",
                                 registry=r, buckets=_STEP_BUCKETS)
        self._batch = Histogram("k3_draft_engine_batch_size", "Requests per propose batch", registry=r,
                                buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self._held = Histogram("k3_draft_batch_held_seconds", "How long a round of proposes was held for "
                               "targets expected back (--batch-wait-ms)", registry=r,
                               buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3))
        self._reclaimed = PCounter("k3_draft_sessions_reclaimed", "Sessions freed after their lease ran out",
                                   registry=r)
        self._session_messages = PCounter("k3_draft_session_messages", "Messages handled, by session",
                                          ["session"], registry=r)
        self.active = Gauge("k3_draft_active_requests", "Active requests", registry=r)
        self.retained = Gauge("k3_draft_retained_requests", "Retained (reconnectable) requests", registry=r)
        self.sessions = Gauge("k3_draft_sessions", "Open client sessions", registry=r)
        self.pool_used = Gauge("k3_draft_pool_used_blocks", "Context blocks in use", registry=r)
        self.pool_total = Gauge("k3_draft_pool_blocks", "Context blocks in the pool", registry=r)
        self.session_active = Gauge("k3_draft_session_active_requests", "Active requests, by session",
                                    ["session"], registry=r)
        self.session_blocks = Gauge("k3_draft_session_pool_blocks", "Pool blocks held, by session",
                                    ["session"], registry=r)
        self.session_share = Gauge("k3_draft_session_pool_share_blocks",
                                   "Pool blocks the session is guaranteed now (its fair share)", ["session"],
                                   registry=r)
        self._gave_back = PCounter("k3_draft_session_gave_back",
                                   "Times a session over its fair share gave room back to one within its own, "
                                   "by what it gave (retained context, active request)", ["session", "kind"],
                                   registry=r)
        self._by_op: dict[str, tuple] = {}     # op -> its (messages, latency) children
        self._by_code: dict[str, PCounter] = {}
        self._session_names: set[str] = set()
        self._lock = threading.Lock()
        self._pending: list[tuple] = []        # (kind, label, value) not yet in Prometheus
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.ingested_rows = 0
        self.proposals = 0
        self.tokens_proposed = 0
        self.engine_batches = 0
        self.sessions_reclaimed = 0
        self.batches_held = 0

    def _add(self, kind: str, label: str | tuple[str, ...], value: float) -> None:
        with self._lock:
            self._pending.append((kind, label, value))

    def message(self, op: str, seconds: float) -> None:
        self.ops[op] += 1
        self._add("message", op, seconds)

    def error(self, code: str) -> None:
        self.errors[code] += 1
        self._add("error", code, 1)

    def rows(self, n: int, seconds: float) -> None:
        if n:
            self.ingested_rows += n
            self._add("rows", "", n)
            self._add("ingest", "", seconds)

    def engine_step(self, batch: int, seconds: float) -> None:
        self.engine_batches += 1
        self._add("engine", "", seconds)
        self._add("batch", "", batch)

    def batch_held(self, seconds: float) -> None:
        self.batches_held += 1
        self._add("held", "", seconds)

    def proposed(self, requests: int, tokens: int) -> None:
        self.proposals += requests
        self.tokens_proposed += tokens
        self._add("proposed", "", requests)
        self._add("tokens", "", tokens)

    def gave_back(self, session: str, kind: str) -> None:
        self._add("gave_back", (self.session_label(session), kind), 1)

    def reclaimed(self, session: str) -> None:
        self.sessions_reclaimed += 1
        self._add("reclaimed", session, 1)

    def flush(self) -> None:
        """Move everything recorded since the last flush into the Prometheus objects."""
        with self._lock:
            pending, self._pending = self._pending, []
        for kind, label, value in pending:
            if kind == "message":
                children = self._by_op.get(label)
                if children is None:
                    children = self._by_op[label] = (self._messages.labels(label), self._latency.labels(label))
                children[0].inc()
                children[1].observe(value)
            elif kind == "error":
                child = self._by_code.get(label)
                if child is None:
                    child = self._by_code[label] = self._errors.labels(label)
                child.inc()
            elif kind == "session":
                self._session_messages.labels(label).inc()
            elif kind == "gave_back":
                self._gave_back.labels(*label).inc(value)
            elif kind == "closed":
                self._end_series(label)
            else:
                _SIMPLE[kind](self, value)

    def session_label(self, name: str) -> str:
        """A bounded label set: at most MAX_SESSION_LABELS open sessions by name, the rest "other"."""
        if name in self._session_names:
            return name
        if len(self._session_names) < MAX_SESSION_LABELS:
            self._session_names.add(name)
            return name
        return "other"

    def session_message(self, name: str) -> None:
        self._add("session", self.session_label(name), 1)

    def session_closed(self, name: str) -> None:
        """A session ended: its series end (after what it still has pending) and its label is
        free for a new session."""
        if name in self._session_names:
            self._session_names.discard(name)
            self._add("closed", name, 0)

    def _end_series(self, name: str) -> None:
        for family, labels in ((self._session_messages, [(name,)]), (self.session_active, [(name,)]),
                               (self.session_blocks, [(name,)]), (self.session_share, [(name,)]),
                               (self._gave_back, [(name, "retained"), (name, "active")])):
            for values in labels:
                try:
                    family.remove(*values)
                except KeyError:
                    pass

    def refresh(self, summary: Callable[[], dict]) -> None:
        """Set the gauges from the store's summary (called when /metrics is read)."""
        s = summary()
        self.active.set(s["active"])
        self.retained.set(s["retained"])
        self.sessions.set(len(s["sessions"]))
        self.pool_total.set(s["pool_blocks"])
        self.pool_used.set(s["pool_blocks"] - s["pool_free_blocks"])
        per = {key: Counter() for key in ("active", "blocks", "share_blocks")}
        for name, info in s["sessions"].items():
            label = self.session_label(name)
            for key, counts in per.items():
                counts[label] += info[key]
        for label in self._session_names | {"other"}:
            self.session_active.labels(label).set(per["active"].get(label, 0))
            self.session_blocks.labels(label).set(per["blocks"].get(label, 0))
            self.session_share.labels(label).set(per["share_blocks"].get(label, 0))

    def snapshot(self) -> dict:
        return {"ops": dict(self.ops), "errors": dict(self.errors), "ingested_rows": self.ingested_rows,
                "proposals": self.proposals, "tokens_proposed": self.tokens_proposed,
                "engine_batches": self.engine_batches, "batches_held": self.batches_held,
                "sessions_reclaimed": self.sessions_reclaimed}


_SIMPLE: dict[str, Callable[[ServerMetrics, float], None]] = {
    "rows": lambda m, v: m._rows.inc(v), "ingest": lambda m, v: m._ingest.observe(v),
    "engine": lambda m, v: m._engine.observe(v), "batch": lambda m, v: m._batch.observe(v),
    "proposed": lambda m, v: m._proposals.inc(v), "tokens": lambda m, v: m._tokens.inc(v),
    "reclaimed": lambda m, v: m._reclaimed.inc(v), "held": lambda m, v: m._held.observe(v)}
