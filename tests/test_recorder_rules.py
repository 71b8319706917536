"""The peer oracle's evidence (demo/recorder.py): every request's recorded drafts are the row the
drafter made for it, keyed by its own prompt; requests vLLM discards this step, or that can take
no draft (max_tokens 1), record nothing. Both sides of the oracle use the recorder, so a wrong row
would be wrong on both and never caught by comparing them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from k3_accel.demo import recorder


def _runner(prompts: dict[str, list[int]], max_tokens: dict[str, int], discard: list[bool]):
    ids = list(prompts)
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(ids), req_ids=ids),
        discard_request_mask=SimpleNamespace(np=np.array(discard)),
        requests={r: SimpleNamespace(prompt_token_ids=prompts[r],
                                     sampling_params=SimpleNamespace(max_tokens=max_tokens[r])) for r in ids})


def test_each_request_records_its_own_row():
    recorder._state.update(run="t", drafts={}, calls={}, call=0)
    try:
        runner = _runner({"a": [1, 2], "b": [3, 4], "c": [5], "d": [6, 7, 8]},
                         {"a": 8, "b": 8, "c": 1, "d": 8}, [False, False, False, True])
        recorder._record(runner, torch.tensor([[10, 11], [20, 21], [30, 31], [40, 41]]))
        recorder._record(runner, torch.tensor([[12, 13], [22, 23], [32, 33], [42, 43]]))
        drafts, calls = recorder.stop()
    finally:
        recorder._state.update(run=None)
    assert drafts == {"1 2": [[10, 11], [12, 13]], "3 4": [[20, 21], [22, 23]]}
    assert calls == {"1 2": [1, 2], "3 4": [1, 2]}
