"""Prompt-lookup (n-gram) drafting over each request's own token history.

What vLLM's ``ngram`` method does, served remotely: the longest n-gram
(``max_n`` down to ``min_n``) that ends the history (context + anchor) and
occurred earlier wins; the tokens that followed its *earliest* occurrence are
the draft (vLLM's tie rule). Needs no weights and no hidden states.

Each request keeps an index ``gram -> start of its earliest occurrence`` per
n, updated as rows arrive, so a proposal costs O(max_n), not O(history).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from k3_accel.server.engines.base import DraftEngine, EngineCaps, Proposal


def lookup(history: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Reference (no index): up to ``k`` tokens after the earliest occurrence of
    the longest suffix n-gram that also occurs earlier in ``history``."""
    hist = np.asarray(history, dtype=np.int64)
    for n in range(min(max_n, len(hist) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
        hits = np.flatnonzero((windows == hist[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return hist[start:start + k].tolist()
    return []


@dataclass
class NgramState:
    max_n: int
    tokens: list[int] = field(default_factory=list)
    first: list[dict] = field(default_factory=list)   # first[n-1][gram] = start of earliest occurrence

    def __post_init__(self) -> None:
        self.first = [{} for _ in range(self.max_n)]

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(t)
            end = len(toks)
            for n in range(1, min(self.max_n, end) + 1):
                self.first[n - 1].setdefault(tuple(toks[end - n:]), end - n)

    def rebuild(self, length: int) -> None:
        tokens = self.tokens[:length]
        self.tokens, self.first = [], [{} for _ in range(self.max_n)]
        self.extend(tokens)

    def propose(self, anchor: int, k: int, min_n: int) -> list[int]:
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length), min_n - 1, -1):
            start = self.first[n - 1].get((*toks[length - n + 1:], anchor) if n > 1 else (anchor,))
            if start is not None:
                begin = start + n
                out = toks[begin:begin + k]
                if len(out) < k and begin + len(out) == length:
                    out = out + [anchor]          # the continuation may run into the anchor
                return out[:k]
        return []


class NgramEngine(DraftEngine):
    def __init__(self, *, max_spec_tokens: int = 16, min_n: int = 1, max_n: int = 3,
                 block_size: int = 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.caps = EngineCaps(kind="ngram", needs_hidden_states=False, context_width=0,
                               max_spec_tokens=max_spec_tokens, block_size=block_size)

    @property
    def bytes_per_row(self) -> int:
        return 8 * (1 + self.max_n)  # the token id kept by the server and by the index

    def new_state(self) -> NgramState:
        return NgramState(self.max_n)

    def append(self, state: NgramState, positions, token_ids, hidden) -> None:
        state.extend(token_ids.tolist())

    def truncate(self, state: NgramState, length: int) -> None:
        state.rebuild(length)

    def fork(self, state: NgramState, length: int) -> NgramState:
        new = NgramState(self.max_n, list(state.tokens))
        new.rebuild(length)
        return new

    def propose(self, states: list[Any], histories, anchors, k, want_logits=False) -> Proposal:
        rows = []
        for state, anchor in zip(states, anchors):
            found = state.propose(anchor, k, self.min_n)
            rows.extend(found)
            rows.extend([-1] * (k - len(found)))
        return Proposal(tokens=torch.tensor(rows, dtype=torch.int64).reshape(len(states), k))
