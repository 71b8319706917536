"""Token histories of remote requests and the retained-prefix index.

When the target's prefix cache serves the first ``p`` tokens of a new
request, the target computes no hidden rows for them, so the draft server
must get that context from a request that already holds it (``reconnect``).
:class:`PrefixIndex` finds the request (active or retained) sharing the
longest block-aligned prefix with the new prompt. Nothing is hashed or
copied per step: histories grow in place, and candidates are compared with
numpy only when a new request starts past position 0 (a prefix-cache hit).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np


class TokenHistory:
    """A growable int64 array: the token id of every context row sent so far."""

    def __init__(self, capacity: int = 256):
        self._buf = np.empty(max(capacity, 16), dtype=np.int64)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def view(self) -> np.ndarray:
        return self._buf[:self._len]

    def write(self, start: int, tokens: np.ndarray) -> None:
        """Put ``tokens`` at ``start`` (<= len), dropping anything after them (rewind)."""
        if not 0 <= start <= self._len:
            raise ValueError(f"history write at {start}, length {self._len}")
        end = start + len(tokens)
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=np.int64)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._buf[start:end] = tokens
        self._len = end


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixIndex:
    """Requests whose context may serve as a reconnect source.

    Active requests are sources while they live; on :meth:`retain` a request
    moves to an LRU of at most ``max_retained`` entries (the server keeps its
    own, possibly smaller LRU: a stale entry just makes a reconnect fail).
    """

    def __init__(self, block_size: int, max_retained: int = 256):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_retained = max_retained
        self._histories: dict[str, TokenHistory] = {}
        self._retained: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._histories)

    def track(self, req_id: str, history: TokenHistory) -> None:
        """Make an active request a candidate source."""
        self._retained.pop(req_id, None)
        self._histories[req_id] = history

    def retain(self, req_id: str) -> None:
        """The request left the batch but the server keeps its context."""
        if req_id not in self._histories:
            return
        self._retained[req_id] = None
        self._retained.move_to_end(req_id)
        while len(self._retained) > self.max_retained:
            old, _ = self._retained.popitem(last=False)
            self._histories.pop(old, None)

    def forget(self, req_id: str) -> None:
        self._retained.pop(req_id, None)
        self._histories.pop(req_id, None)

    def clear(self) -> None:
        self._retained.clear()
        self._histories.clear()

    def lookup(self, prompt: Sequence[int] | np.ndarray, upto: int,
               exclude: str | None = None) -> tuple[str, int] | None:
        """``(source_id, length)``: the longest block-aligned shared prefix <= ``upto``."""
        prompt = np.asarray(prompt, dtype=np.int64)[:upto]
        bs = self.block_size
        if len(prompt) < bs:
            return None
        best: tuple[str, int] | None = None
        for req_id, history in self._candidates():
            if req_id == exclude:
                continue
            length = common_prefix(prompt, history.view()) // bs * bs
            if length >= bs and (best is None or length > best[1]):
                best = (req_id, length)
        return best

    def _candidates(self):
        """Most recently retained first, then active requests."""
        for req_id in reversed(self._retained):
            yield req_id, self._histories[req_id]
        for req_id, history in self._histories.items():
            if req_id not in self._retained:
                yield req_id, history
