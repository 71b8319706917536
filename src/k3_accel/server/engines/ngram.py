"""Prompt-lookup (n-gram) drafting over each request's own token history.

What vLLM's ``ngram`` method does, served remotely: find the longest n-gram
(``max_n`` down to ``min_n``) that ends the history and occurred earlier; the
tokens that followed its most recent earlier occurrence are the draft.
Needs no weights and no hidden states.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from k3_accel.server.engines.base import DraftEngine, EngineCaps, Proposal


def lookup(history: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to ``k`` tokens continuing the longest earlier match of the history's suffix."""
    hist = np.asarray(history, dtype=np.int64)
    for n in range(min(max_n, len(hist) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
        hits = np.flatnonzero((windows == hist[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return hist[start:start + k].tolist()
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
        return 8  # the token id the server keeps per row

    def new_state(self) -> Any:
        return None

    def append(self, state, positions, token_ids, hidden) -> None:
        return None

    def truncate(self, state, length: int) -> None:
        return None

    def fork(self, state, length: int) -> Any:
        return None

    def propose(self, states, histories, anchors, k, want_logits=False) -> Proposal:
        drafts = torch.full((len(states), k), -1, dtype=torch.int64)
        for i, (history, anchor) in enumerate(zip(histories, anchors)):
            found = lookup([*history, anchor], k, self.min_n, self.max_n)
            drafts[i, :len(found)] = torch.tensor(found, dtype=torch.int64)
        return Proposal(tokens=drafts)
