"""Reference implementations the tests compare the served ones with (never in the serving path)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def ngram_lookup(history: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Prompt lookup without an index: up to ``k`` tokens after the earliest occurrence of
    the longest suffix n-gram that also occurs earlier in ``history`` (vLLM's rule)."""
    hist = np.asarray(history, dtype=np.int64)
    for n in range(min(max_n, len(hist) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
        hits = np.flatnonzero((windows == hist[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return hist[start:start + k].tolist()
    return []
