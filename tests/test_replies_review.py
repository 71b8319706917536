"""Review (s30) of the propose reply reader (:mod:`k3_accel.transport.replies`): "a reply of the
wrong shape fails its requests (a message failure)" holds for every tensor of the reply, not only
the drafts: a confidence (or logits) frame whose rows do not match the proposing requests fails
them, typed, instead of raising a shape error out of the client's step."""
from __future__ import annotations

import numpy as np
import torch

from helpers.steps import step
from k3_accel.protocol import Reply
from k3_accel.transport.api import StepOutput
from k3_accel.transport.failures import FailureKind, FailureQueue
from k3_accel.transport.replies import ReplyReader
from k3_accel.transport.timing import Telemetry


def _fill(tensors: dict) -> tuple[StepOutput, list]:
    inp = step(["a", "b", "c"], [(0, [1, 2]), (0, [3, 4]), (0, [5, 6])], k=2)
    out = StepOutput.empty(inp.num_requests, inp.k)
    failures = FailureQueue()
    rows = np.array([0, 2], dtype=np.int64)               # "a" and "c" proposed, in reply order
    ReplyReader("tcp://127.0.0.1:1", 100, failures, Telemetry()).fill(
        inp, out, rows, Reply(1, True, "srv", tensors=tensors))
    return out, failures.drain()


def test_a_reply_whose_tensors_match_fills_the_proposing_rows():
    drafts = torch.tensor([[7, 8], [9, 10]], dtype=torch.int32)
    out, failures = _fill({"drafts": drafts, "confidence": torch.full((2, 2), 0.5)})
    assert failures == []
    assert out.drafts.tolist() == [[7, 8], [-1, -1], [9, 10]]
    assert out.extra["confidence"].tolist() == [[0.5, 0.5], [0.0, 0.0], [0.5, 0.5]]


def test_a_confidence_of_the_wrong_shape_fails_the_proposing_requests_typed():
    drafts = torch.tensor([[7, 8], [9, 10]], dtype=torch.int32)
    for confidence in (torch.full((3, 2), 0.5), torch.full((2, 3), 0.5)):
        out, failures = _fill({"drafts": drafts, "confidence": confidence})
        assert [(f.kind, f.ids) for f in failures] == [(FailureKind.MESSAGE, ("a", "c"))]
        assert out.drafts.tolist() == [[-1, -1]] * 3       # no drafts from a reply it cannot read
        assert "confidence" not in out.extra


def test_a_tensor_this_client_does_not_know_never_fails_the_reply():
    """A newer server's extra tensor: kept when it has a row per request, else left out; the drafts stand."""
    drafts = torch.tensor([[7, 8], [9, 10]], dtype=torch.int32)
    out, failures = _fill({"drafts": drafts, "per_request": torch.ones(2), "summary": torch.ones(5)})
    assert failures == [] and out.drafts.tolist() == [[7, 8], [-1, -1], [9, 10]]
    assert out.extra["per_request"].tolist() == [1.0, 0.0, 1.0] and "summary" not in out.extra
