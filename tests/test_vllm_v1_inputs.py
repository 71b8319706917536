"""The V1 adapter's step building (pure tensor code, no vLLM needed)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from k3_accel.transport.api import ClientSettings
from k3_accel.vllm.v1_inputs import (DraftBatch, KnownRequests, dflash_step, draft_lists, needs_no_drafts,
                                     row_index, scatter_drafts, token_step)

SETTINGS = ClientSettings(address="tcp://127.0.0.1:1", max_rows=64, context_width=4, hidden_dtype=torch.float32)


def _rows(index, n=100):
    return torch.arange(n)[index].tolist()


def test_row_index_is_a_slice_when_segments_touch():
    index = row_index(np.array([0, 3, 5]), np.array([3, 2, 4]))
    assert index == slice(0, 9)


def test_row_index_skips_rejected_rows():
    # three requests scheduled 4 rows each; 1, 4 and 2 of them are valid
    index = row_index(np.array([0, 4, 8]), np.array([1, 4, 2]))
    assert isinstance(index, torch.Tensor)
    assert _rows(index) == [0, 4, 5, 6, 7, 8, 9]


def test_row_index_of_a_subset():
    assert _rows(row_index(np.array([4]), np.array([3]))) == [4, 5, 6]
    assert _rows(row_index(np.array([], dtype=np.int64), np.array([], dtype=np.int64))) == []


def _batch():
    # request a: 2 rows (verify block of 4, 2 rejected); b: 4 rows (prefill chunk, not sampled); c: 1 row
    return DraftBatch.from_runner(["a", "b", "c"], torch.tensor([0, 4, 8, 9], dtype=torch.int32),
                                  torch.tensor([2, 0, 0], dtype=torch.int32), np.array([False, True, False]))


def test_draft_batch_from_runner():
    b = _batch()
    assert b.counts.tolist() == [2, 4, 1]
    assert b.starts.tolist() == [0, 4, 8]
    assert b.sampled.tolist() == [True, False, True]


def test_dflash_step_gathers_valid_rows_and_anchors():
    positions = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3, 7])
    token_ids = torch.arange(100, 109, dtype=torch.int32)
    hidden = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4)
    inp = dflash_step(_batch(), [0, 1, 2], token_ids=token_ids, positions=positions, hidden=hidden,
                      next_token_ids=torch.tensor([55, 66, 77], dtype=torch.int32), k=3,
                      prompts={"a": [1, 2]})
    inp.validate(SETTINGS)
    assert inp.counts == [2, 4, 1]
    assert inp.positions.tolist() == [10, 11, 0, 1, 2, 3, 7]
    assert inp.token_ids.tolist() == [100, 101, 104, 105, 106, 107, 108]
    assert torch.equal(inp.hidden, hidden[[0, 1, 4, 5, 6, 7, 8]])
    assert inp.anchor_positions.tolist() == [12, 4, 8]
    assert inp.anchor_tokens.tolist() == [55, 66, 77]
    assert inp.sampled == [True, False, True] and inp.k == 3
    assert inp.prompt_token_ids == {"a": [1, 2]}


def test_dflash_step_of_kept_requests_only():
    positions = torch.tensor([[10, 11, 12, 13, 0, 1, 2, 3, 7]] * 3)      # M-RoPE layout: first row used
    inp = dflash_step(_batch(), [2], token_ids=torch.arange(9), positions=positions, hidden=None,
                      next_token_ids=torch.tensor([55, 66, 77]), k=2)
    assert inp.req_ids == ["c"] and inp.counts == [1]
    assert inp.positions.tolist() == [7] and inp.token_ids.tolist() == [8]
    assert inp.anchor_tokens.tolist() == [77] and inp.anchor_positions.tolist() == [8]
    assert inp.hidden is None and inp.prompt_token_ids is None


def test_token_step_decode_and_prefill_chunk():
    tokens = np.zeros((3, 16), dtype=np.int32)
    tokens[0, :8] = [1, 2, 3, 4, 5, 6, 7, 8]       # decode: computed 5, verified through 7, sampled 8
    tokens[2, :10] = np.arange(20, 30)             # prefill: 10-token prompt, chunk of 4 after 2 cached
    inp = token_step(["a", "c"], [0, 2], computed=np.array([5, 0, 2]), scheduled=np.array([3, 1, 4]),
                     num_tokens=np.array([8, 0, 10]), token_ids=tokens, sampled=[True, False], k=4,
                     prompts={"c": list(range(20, 30))})
    inp.validate(SETTINGS)
    assert inp.counts == [2, 4]
    assert inp.positions.tolist() == [5, 6, 2, 3, 4, 5]
    assert inp.token_ids.tolist() == [6, 7, 22, 23, 24, 25]
    assert inp.anchor_tokens == [8, 26] and inp.anchor_positions == [7, 6]
    assert inp.sampled == [True, False]
    assert inp.hidden is None and inp.prompt_token_ids == {"c": list(range(20, 30))}


def test_scatter_and_lists():
    drafts = torch.tensor([[5, 6, -1], [-1, -1, -1]])
    full = scatter_drafts(drafts, [1, 3], 4, 3)
    assert full.tolist() == [[-1] * 3, [5, 6, -1], [-1] * 3, [-1] * 3]
    assert scatter_drafts(drafts, [0, 1], 2, 3) is drafts
    assert draft_lists(full) == [[], [5, 6], [], []]
    assert scatter_drafts(torch.empty((0, 2), dtype=torch.int64), [], 2, 2).tolist() == [[-1, -1]] * 2


@pytest.mark.parametrize("max_tokens,expected", [(1, True), (0, True), (2, False), (None, False)])
def test_needs_no_drafts(max_tokens, expected):
    assert needs_no_drafts(SimpleNamespace(max_tokens=max_tokens)) is expected
    assert needs_no_drafts(None) is False


def test_known_requests():
    known = KnownRequests()
    assert known.new(["a", "b"]) == ["a", "b"]
    assert known.new(["b", "c"]) == ["c"]
    assert known.departed({"b": 1}) == ["a", "c"]
    assert known.departed(["b"]) == []
    assert known.new(["a"]) == ["a"]
