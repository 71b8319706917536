"""Op handlers: a decoded request in, a reply out. No sockets here."""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

import torch

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError, Reply, RequestResult
from k3_accel.server.engines.base import DraftEngine, EngineError
from k3_accel.server.metrics import ServerMetrics
from k3_accel.server.state import RequestError, RequestTable


@dataclass(frozen=True)
class Rows:
    """One request's slice of a message's context rows."""
    positions: torch.Tensor
    token_ids: torch.Tensor
    hidden: torch.Tensor | None


def new_server_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


class DraftService:
    def __init__(self, engine: DraftEngine, table: RequestTable, metrics: ServerMetrics,
                 max_requests: int):
        self.engine = engine
        self.table = table
        self.metrics = metrics
        self.max_requests = max_requests
        self.server_id = new_server_id()
        self._phases: dict[str, float] = {}   # seconds per phase of the message in hand
        self._handlers = {p.Hello: self._hello, p.Ingest: self._ingest, p.Propose: self._propose,
                          p.Free: self._free, p.Clear: self._clear, p.Reconnect: self._reconnect,
                          p.Stats: self._stats}

    # ------------------------------------------------------------------ entry
    def handle(self, req: p.Request) -> Reply:
        """Run one request; every failure becomes a typed error reply."""
        started = time.perf_counter()
        self._phases = {}
        try:
            body, tensors = self._handlers[type(req.msg)](req)
            body["timing"] = {**self._phases, "handle": time.perf_counter() - started}
            reply = Reply(seq=req.seq, ok=True, server_id=self.server_id, body=body, tensors=tensors)
        except ProtocolError as exc:
            reply = p.error_reply(req.seq, self.server_id, exc.code, exc.message)
        except Exception as exc:  # an engine bug must not take the server down
            reply = p.error_reply(req.seq, self.server_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        self._account(req.op, reply, time.perf_counter() - started)
        return reply

    def reject(self, exc: ProtocolError) -> Reply:
        """The reply to a message that could not even be decoded."""
        self.metrics.error(exc.code.value)
        return p.error_reply(exc.seq, self.server_id, exc.code, exc.message)

    def _account(self, op: str, reply: Reply, seconds: float) -> None:
        self.metrics.message(op, seconds)
        if not reply.ok:
            self.metrics.error(reply.error["code"])
        for result in reply.body.get("results", []):
            if not result["ok"]:
                self.metrics.error(result["code"])
        self.metrics.active.set(len(self.table.active))
        self.metrics.retained.set(len(self.table.retained))
        self.metrics.used_bytes.set(self.table.used_bytes)

    # ------------------------------------------------------------- context
    def _split_rows(self, spans: list, tensors: dict[str, torch.Tensor]) -> list[Rows]:
        """Check the context tensors against the spans and cut them per request."""
        total = sum(s.count for s in spans)
        if any(s.count < 0 for s in spans):
            raise ProtocolError(ErrorCode.BAD_FIELD, "row counts must be >= 0")
        if len({s.id for s in spans}) != len(spans):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a request id appears twice in one message")
        if total == 0:
            return [Rows(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), None)
                    for _ in spans]
        positions, token_ids = self._row_tensor(tensors, "positions", total), self._row_tensor(tensors, "token_ids", total)
        hidden = self._hidden(tensors.get("hidden"), total)
        cuts = [s.count for s in spans]
        hid = hidden.split(cuts) if hidden is not None else [None] * len(spans)
        return [Rows(a, b, c) for a, b, c in zip(positions.split(cuts), token_ids.split(cuts), hid)]

    @staticmethod
    def _row_tensor(tensors: dict, name: str, total: int) -> torch.Tensor:
        t = tensors.get(name)
        if t is None or t.dtype != torch.int64 or tuple(t.shape) != (total,):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor '{name}' must be int64 of shape [{total}]")
        return t

    def _hidden(self, hidden: torch.Tensor | None, total: int) -> torch.Tensor | None:
        caps = self.engine.caps
        if hidden is None:
            if caps.needs_hidden_states:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"engine {caps.kind} needs tensor 'hidden'")
            return None
        if tuple(hidden.shape) != (total, caps.context_width):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor 'hidden' has shape {list(hidden.shape)}, "
                                                       f"expected [{total}, {caps.context_width}]")
        if p.dtype_name(hidden.dtype) not in caps.hidden_dtypes:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden dtype {hidden.dtype} not in {caps.hidden_dtypes}")
        return hidden

    def _store_all(self, spans: list, rows: list[Rows]) -> list[RequestResult]:
        """Store every request's rows; one result per request, rows counted once."""
        results, stored = [], 0
        for span, r in zip(spans, rows):
            try:
                self.table.store(span.id, r.positions, r.token_ids, r.hidden)
            except RequestError as exc:
                results.append(RequestResult(span.id, False, exc.code.value, exc.message))
                continue
            stored += r.positions.numel()
            results.append(RequestResult(span.id))
        self.metrics.rows(stored)
        return results

    # ------------------------------------------------------------------ ops
    def _hello(self, req: p.Request):
        caps = self.engine.caps
        server_caps = p.ServerCaps(
            engine=caps.kind, needs_hidden_states=caps.needs_hidden_states, context_width=caps.context_width,
            hidden_dtypes=list(caps.hidden_dtypes), supports_logits=caps.supports_logits,
            supports_topk=caps.supports_topk, max_requests=self.max_requests,
            max_spec_tokens=caps.max_spec_tokens, block_size=caps.block_size, vocab_size=caps.vocab_size)
        return {"caps": p.to_body(server_caps), "aux_layer_ids": list(caps.aux_layer_ids),
                "mask_token_id": caps.mask_token_id}, {}

    def _ingest(self, req: p.Request):
        rows = self._split_rows(req.msg.requests, req.tensors)
        results = self._store_all(req.msg.requests, rows)
        return {"results": [p.to_body(r) for r in results]}, {}

    def _check_propose(self, msg: p.Propose) -> None:
        caps = self.engine.caps
        if not 0 <= msg.k <= caps.max_spec_tokens:
            raise ProtocolError(ErrorCode.K_TOO_LARGE, f"k={msg.k}, the server allows 0..{caps.max_spec_tokens}")
        if msg.logits == "full" and not caps.supports_logits:
            raise ProtocolError(ErrorCode.UNSUPPORTED, f"engine {caps.kind} returns no logits")
        if msg.logits == "topk" and not (caps.supports_topk and msg.topk > 0):
            raise ProtocolError(ErrorCode.UNSUPPORTED, f"engine {caps.kind} top-k needs supports_topk and topk > 0")

    def _propose(self, req: p.Request):
        msg = req.msg
        self._check_propose(msg)
        started = time.perf_counter()
        rows = self._split_rows(msg.requests, req.tensors)
        results = self._store_all(msg.requests, rows)
        results = [self._check_anchor(item, res) for item, res in zip(msg.requests, results)]
        self._phases["store"] = time.perf_counter() - started
        ready = [i for i, r in enumerate(results) if r.ok]
        drafts = torch.full((len(msg.requests), msg.k), -1, dtype=torch.int64)
        tensors = {"drafts": drafts}
        if ready and msg.k > 0:
            started = time.perf_counter()
            proposal = self._run_engine(msg, ready)
            self._phases["engine"] = time.perf_counter() - started
            drafts[ready] = proposal.tokens
            tensors.update(self._logits_tensors(msg, ready, proposal.logits))
            self.metrics.proposed(len(ready), int((proposal.tokens >= 0).sum()))
        return {"results": [p.to_body(r) for r in results]}, tensors

    def _check_anchor(self, item: p.ProposeItem, result: RequestResult) -> RequestResult:
        if not result.ok:
            return result
        length = self.table.get(item.id).length
        if item.anchor_position != length:
            return RequestResult(item.id, False, ErrorCode.CONTEXT_GAP.value,
                                 f"anchor at position {item.anchor_position}, context ends at {length}")
        return result

    def _run_engine(self, msg: p.Propose, ready: list[int]):
        states = [self.table.get(msg.requests[i].id) for i in ready]
        anchors = [msg.requests[i].anchor_token for i in ready]
        try:
            return self.engine.propose([s.engine_state for s in states], [s.tokens for s in states],
                                       anchors, msg.k, want_logits=msg.logits != "none")
        except EngineError as exc:
            raise ProtocolError(exc.code, str(exc)) from None

    def _logits_tensors(self, msg: p.Propose, ready: list[int], logits: torch.Tensor | None) -> dict:
        if msg.logits == "none" or logits is None:
            return {}
        if msg.logits == "full":
            full = torch.zeros((len(msg.requests), *logits.shape[1:]), dtype=torch.bfloat16)
            full[ready] = logits.to(torch.bfloat16)
            return {"logits": full}
        values, indices = logits.float().topk(min(msg.topk, logits.shape[-1]), dim=-1)
        out_v = torch.zeros((len(msg.requests), *values.shape[1:]), dtype=torch.bfloat16)
        out_i = torch.full((len(msg.requests), *values.shape[1:]), -1, dtype=torch.int64)
        out_v[ready], out_i[ready] = values.to(torch.bfloat16), indices
        return {"topk_values": out_v, "topk_indices": out_i}

    def _free(self, req: p.Request):
        self.table.free(req.msg.ids, req.msg.retain)
        return {}, {}

    def _clear(self, req: p.Request):
        self.table.clear()
        return {}, {}

    def _reconnect(self, req: p.Request):
        token_ids = req.tensors.get("token_ids")
        if token_ids is None or token_ids.dtype != torch.int64 or token_ids.dim() != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "reconnect needs an int64 tensor 'token_ids' [length]")
        if token_ids.numel() != req.msg.length:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"token_ids has {token_ids.numel()} ids, length is {req.msg.length}")
        try:
            restored = self.table.reconnect(req.msg.source, req.msg.id, token_ids, self.engine.caps.block_size)
        except RequestError as exc:
            raise ProtocolError(exc.code, exc.message) from None
        return {"restored": restored}, {}

    def _stats(self, req: p.Request):
        return {"stats": {**self.metrics.snapshot(), "active": len(self.table.active),
                          "retained": len(self.table.retained), "used_bytes": self.table.used_bytes,
                          "budget_bytes": self.table.budget_bytes}}, {}
