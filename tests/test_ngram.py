"""Prompt lookup on crafted histories."""
from __future__ import annotations

import torch

from k3_accel.server.engines.ngram import NgramEngine, lookup


def test_longest_suffix_match_wins():
    # suffix "1 2 3" occurred once (followed by 9); "2 3" alone also occurs followed by 7
    history = [2, 3, 7, 1, 2, 3, 9, 8, 1, 2, 3]
    assert lookup(history, 3, 1, 3) == [9, 8, 1]
    assert lookup(history, 3, 1, 1) == [9, 8, 1]   # most recent "3" is at index 5


def test_most_recent_occurrence_and_short_continuation():
    assert lookup([4, 5, 6, 4, 5, 7, 4, 5], 4, 2, 2) == [7, 4, 5]
    assert lookup([1, 2, 3], 4) == []              # no repeat: no draft
    assert lookup([1], 4) == []


def test_min_n_is_respected():
    assert lookup([1, 9, 1], 2, 2, 3) == []        # only a 1-gram would match
    assert lookup([1, 9, 1], 2, 1, 3) == [9, 1]


def test_engine_pads_with_minus_one():
    engine = NgramEngine(max_spec_tokens=8)
    prop = engine.propose([None, None], [[1, 2, 1], [5, 6]], [2, 7], k=4)
    assert prop.tokens.dtype == torch.int64
    assert prop.tokens.tolist() == [[1, 2, -1, -1], [-1, -1, -1, -1]]
