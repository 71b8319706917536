"""Server counters: Prometheus metrics plus a plain snapshot for the ``stats`` op."""
from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, Counter as PCounter, Gauge, Histogram


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
                                  buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0))
        self.active = Gauge("k3_draft_active_requests", "Active requests", registry=r)
        self.retained = Gauge("k3_draft_retained_requests", "Retained (reconnectable) requests", registry=r)
        self.used_bytes = Gauge("k3_draft_state_bytes", "Bytes of per-request draft state", registry=r)
        self._by_op: dict[str, tuple] = {}     # op -> its (messages, latency) children
        self._by_code: dict[str, PCounter] = {}
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.ingested_rows = 0
        self.proposals = 0
        self.tokens_proposed = 0

    def message(self, op: str, seconds: float) -> None:
        self.ops[op] += 1
        children = self._by_op.get(op)
        if children is None:
            children = self._by_op[op] = (self._messages.labels(op), self._latency.labels(op))
        children[0].inc()
        children[1].observe(seconds)

    def error(self, code: str) -> None:
        self.errors[code] += 1
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self._errors.labels(code)
        child.inc()

    def rows(self, n: int) -> None:
        self.ingested_rows += n
        self._rows.inc(n)

    def proposed(self, requests: int, tokens: int) -> None:
        self.proposals += requests
        self.tokens_proposed += tokens
        self._proposals.inc(requests)
        self._tokens.inc(tokens)

    def snapshot(self) -> dict:
        return {"ops": dict(self.ops), "errors": dict(self.errors), "ingested_rows": self.ingested_rows,
                "proposals": self.proposals, "tokens_proposed": self.tokens_proposed}
