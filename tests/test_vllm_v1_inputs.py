"""The V1 adapter's token-only step building and draft lists (pure tensor code, no vLLM needed)."""
from __future__ import annotations

import numpy as np
import torch

from k3_accel.transport.api import ClientSettings
from k3_accel.vllm.spec_decode.v1_tokens import draft_lists, token_step

SETTINGS = ClientSettings(address="tcp://127.0.0.1:1", max_rows=64, context_width=4, hidden_dtype=torch.float32)


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


def test_draft_lists_cut_at_the_first_no_draft():
    drafts = torch.tensor([[-1] * 3, [5, 6, -1], [7, 8, 9], [-1, 4, 4]])
    assert draft_lists(drafts) == [[], [5, 6], [7, 8, 9], []]
    assert draft_lists(torch.empty((0, 2), dtype=torch.int64)) == []
