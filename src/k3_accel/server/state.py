"""Per-request draft state: active requests, retained prefixes, memory budget.

Every mutation validates first and changes state only once it cannot fail,
so a rejected request leaves the table exactly as it was.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from k3_accel.protocol import ErrorCode
from k3_accel.server.engines.base import DraftEngine, EngineError


class RequestError(Exception):
    """A per-request failure: only this request is affected."""

    def __init__(self, code: ErrorCode | str, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


@dataclass
class RequestState:
    id: str
    engine_state: Any
    tokens: list[int] = field(default_factory=list)  # token id at each stored position

    @property
    def length(self) -> int:
        return len(self.tokens)


class RequestTable:
    def __init__(self, engine: DraftEngine, *, max_requests: int, max_retained: int,
                 budget_bytes: int):
        self.engine = engine
        self.max_requests = max_requests
        self.max_retained = max_retained
        self.budget_bytes = budget_bytes
        self.active: dict[str, RequestState] = {}
        self.retained: OrderedDict[str, RequestState] = OrderedDict()  # LRU: oldest first
        self._rows = 0   # stored rows over active + retained requests

    # ---------------------------------------------------------------- lookups
    @property
    def used_bytes(self) -> int:
        return self._rows * self.engine.bytes_per_row

    def _evict_oldest_retained(self) -> None:
        _, state = self.retained.popitem(last=False)
        self._rows -= state.length

    def get(self, req_id: str) -> RequestState:
        state = self.active.get(req_id)
        if state is None:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST, f"request {req_id!r} is not active")
        return state

    def get_or_create(self, req_id: str) -> RequestState:
        """The active state of ``req_id``; revives a retained one or creates a new one."""
        if req_id in self.active:
            return self.active[req_id]
        if len(self.active) >= self.max_requests:
            raise RequestError(ErrorCode.TOO_MANY_REQUESTS,
                               f"{len(self.active)} requests active, the server's limit is {self.max_requests}")
        state = self.retained.pop(req_id, None) or RequestState(req_id, self.engine.new_state())
        self.active[req_id] = state
        return state

    # ---------------------------------------------------------------- context
    def check_rows(self, state: RequestState, positions: torch.Tensor,
                   hidden: torch.Tensor | None) -> int:
        """Validate rows for ``state``; returns the length to rewind to before appending."""
        n = positions.numel()
        if n == 0:
            return state.length
        start = int(positions[0])
        if start < 0 or (n > 1 and not torch.equal(positions, torch.arange(start, start + n,
                                                                           dtype=positions.dtype))):
            raise RequestError(ErrorCode.BAD_REQUEST, f"request {state.id!r}: positions are not contiguous")
        if start > state.length:
            raise RequestError(ErrorCode.CONTEXT_GAP,
                               f"request {state.id!r}: rows start at {start} but context ends at {state.length}")
        if hidden is not None and not bool(torch.isfinite(hidden).all()):
            raise RequestError(ErrorCode.NON_FINITE, f"request {state.id!r}: hidden rows hold NaN or Inf")
        self._reserve(start + n - state.length)
        return start

    def _reserve(self, new_rows: int) -> None:
        need = new_rows * self.engine.bytes_per_row
        while self.used_bytes + need > self.budget_bytes and self.retained:
            self._evict_oldest_retained()
        if self.used_bytes + need > self.budget_bytes:
            raise RequestError(ErrorCode.CAPACITY,
                               f"draft memory budget exhausted: {self.used_bytes} + {need} bytes "
                               f"> {self.budget_bytes} (raise --memory-budget-mb or free requests)")

    def append(self, state: RequestState, positions: torch.Tensor, token_ids: torch.Tensor,
               hidden: torch.Tensor | None) -> None:
        """Append rows (rewinding first when they start inside the stored context)."""
        start = self.check_rows(state, positions, hidden)
        if positions.numel() == 0:
            return
        try:
            if start < state.length:
                self.engine.truncate(state.engine_state, start)
            self.engine.append(state.engine_state, positions, token_ids, hidden)
        except EngineError as exc:
            raise RequestError(exc.code, str(exc)) from None
        self._rows += start + positions.numel() - state.length
        del state.tokens[start:]
        state.tokens.extend(token_ids.tolist())

    def store(self, req_id: str, positions: torch.Tensor, token_ids: torch.Tensor,
              hidden: torch.Tensor | None) -> RequestState:
        """Create-or-get ``req_id`` and append rows; on failure nothing is left behind."""
        was_active, was_retained = req_id in self.active, req_id in self.retained
        state = self.get_or_create(req_id)
        try:
            self.append(state, positions, token_ids, hidden)
        except RequestError:
            if not was_active:
                del self.active[req_id]
                if was_retained:
                    self.retained[req_id] = state
            raise
        return state

    # ------------------------------------------------------------- lifecycle
    def free(self, req_ids: list[str], retain: bool) -> None:
        for req_id in req_ids:
            state = self.active.pop(req_id, None)
            if state is None:
                continue
            if not retain or self.max_retained <= 0:
                self._rows -= state.length
                continue
            self.retained[req_id] = state
            while len(self.retained) > self.max_retained:
                self._evict_oldest_retained()

    def clear(self) -> None:
        self.active.clear()
        self.retained.clear()
        self._rows = 0

    def reconnect(self, source_id: str, req_id: str, token_ids: torch.Tensor, block: int) -> int:
        """Attach ``req_id`` to a block-aligned prefix of ``source_id``; returns its length."""
        source = self.active.get(source_id) or self.retained.get(source_id)
        if source is None:
            raise RequestError(ErrorCode.UNKNOWN_REQUEST, f"no active or retained request {source_id!r}")
        length = token_ids.numel()
        if length == 0 or length % block:
            raise RequestError(ErrorCode.BAD_REQUEST, f"reconnect length {length} is not a positive multiple of {block}")
        if length > source.length or source.tokens[:length] != token_ids.tolist():
            raise RequestError(ErrorCode.PREFIX_MISMATCH,
                               f"the first {length} tokens do not match request {source_id!r}")
        if req_id not in self.active and len(self.active) >= self.max_requests:
            raise RequestError(ErrorCode.TOO_MANY_REQUESTS, f"the server's limit is {self.max_requests} requests")
        if source_id in self.retained:
            self.retained.move_to_end(source_id)
        self._reserve(length)
        forked = self.engine.fork(source.engine_state, length)
        for old in (self.active.pop(req_id, None), self.retained.pop(req_id, None)):
            self._rows -= old.length if old is not None else 0
        self.active[req_id] = RequestState(req_id, forked, source.tokens[:length])
        self._rows += length
        return length
