"""The runner-independent spec-decode core: rows, the skip rule, the known book, failure logging
(pure tensor code, no vLLM needed)."""
from __future__ import annotations

import collections
import logging

import numpy as np
import pytest
import torch

from k3_accel.transport.api import ClientSettings
from k3_accel.vllm.spec_decode.core import NO_LIMIT, FailureLog, KnownRequests, RemoteDrafter, finishes_after_prefill
from k3_accel.vllm.spec_decode.rows import BatchRows, gather_step

SETTINGS = ClientSettings(address="tcp://127.0.0.1:1", max_rows=64, context_width=4, hidden_dtype=torch.float32)


def _rows(index, n=100):
    return torch.arange(n)[index].tolist()


def _batch(qsl=(0, 4, 8, 9), rejected=(2, 0, 0), sampled=(True, False, True)):
    # request a: 2 valid rows (verify block of 4, 2 rejected); b: 4 (prefill chunk, not sampled); c: 1
    return BatchRows.from_counts(["a", "b", "c"][: len(qsl) - 1], np.array(qsl, dtype=np.int32),
                                 None if rejected is None else np.array(rejected), np.array(sampled))


def test_batch_rows_from_counts():
    b = _batch()
    assert b.starts.tolist() == [0, 4, 8] and b.scheduled.tolist() == [4, 4, 1]
    assert b.valid.tolist() == [2, 4, 1] and b.sampled.tolist() == [True, False, True]
    assert _batch(rejected=None).valid.tolist() == [4, 4, 1]
    with pytest.raises(ValueError, match="request 'c': 1 rows scheduled, 1 rejected: no valid context row"):
        _batch(rejected=(0, 0, 1))


def test_row_index_is_a_slice_when_the_kept_rows_touch():
    b = _batch(rejected=None)
    assert b.row_index(np.arange(3)) == slice(0, 9)
    assert b.row_index(np.array([1, 2])) == slice(4, 9)
    assert b.row_index(np.array([], dtype=np.int64)) == slice(0, 0)


def test_row_index_skips_rejected_rows_and_dropped_requests():
    b = _batch()
    assert _rows(b.row_index(np.arange(3))) == [0, 1, 4, 5, 6, 7, 8]
    assert _rows(b.row_index(np.array([0, 2]))) == [0, 1, 8]
    assert isinstance(b.row_index(np.array([0, 2])), np.ndarray)


def test_gather_step_takes_valid_rows_and_anchors():
    positions = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3, 7])
    token_ids = torch.arange(100, 109, dtype=torch.int32)
    hidden = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4)
    inp = gather_step(_batch(), np.arange(3), positions=positions, token_ids=token_ids, hidden=[hidden],
                      anchor_tokens=torch.tensor([55, 66, 77]), k=3, prompts={"a": [1, 2]})
    inp.validate(SETTINGS)
    assert inp.req_ids == ["a", "b", "c"] and inp.counts == [2, 4, 1]
    assert inp.positions.tolist() == [10, 11, 0, 1, 2, 3, 7]
    assert inp.token_ids.tolist() == [100, 101, 104, 105, 106, 107, 108]
    assert torch.equal(inp.hidden, hidden[[0, 1, 4, 5, 6, 7, 8]])
    assert inp.anchor_positions.tolist() == [12, 4, 8] and inp.anchor_positions.dtype == torch.int64
    assert inp.anchor_tokens.tolist() == [55, 66, 77]
    assert inp.sampled == [True, False, True] and inp.k == 3 and inp.prompt_token_ids == {"a": [1, 2]}


def test_gather_step_of_kept_requests_concatenates_layers():
    positions = torch.tensor([[10, 11, 12, 13, 0, 1, 2, 3, 7]] * 3)      # M-RoPE layout: first row used
    layers = [torch.full((9, 2), float(j)) + torch.arange(9.0).unsqueeze(1) for j in range(2)]
    inp = gather_step(_batch(), np.array([2]), positions=positions, token_ids=torch.arange(9), hidden=layers,
                      anchor_tokens=torch.tensor([77]), k=2)
    assert inp.req_ids == ["c"] and inp.counts == [1]
    assert inp.positions.tolist() == [7] and inp.token_ids.tolist() == [8]
    assert inp.hidden.tolist() == [[8.0, 8.0, 9.0, 9.0]]            # layer 0 then layer 1, row 8
    assert inp.anchor_positions.tolist() == [8] and inp.prompt_token_ids is None
    assert gather_step(_batch(), np.array([2]), positions=positions, token_ids=torch.arange(9), hidden=None,
                       anchor_tokens=[77], k=2).hidden is None


@pytest.mark.parametrize("max_tokens,expected", [(1, True), (0, True), (2, False), (NO_LIMIT, False)])
def test_the_skip_rule(max_tokens, expected):
    assert finishes_after_prefill(np.array([max_tokens])).tolist() == [expected]


def test_known_requests():
    known = KnownRequests()
    assert known.new(["a", "b"]) == ["a", "b"]
    assert known.new(["b", "c"]) == ["c"]
    assert "b" in known and len(known) == 3
    assert known.departed({"b": 1}) == ["a", "c"]
    assert known.departed(["b"]) == []
    assert known.new(["a"]) == ["a"]
    known.forget(["a", "zzz"])
    assert known.ids == {"b"}


def test_failure_log_counts_every_failure_and_logs_only_the_first(caplog):
    counters: collections.Counter = collections.Counter()
    failures = FailureLog(counters, limit=2)
    with caplog.at_level(logging.DEBUG, logger="k3_accel.vllm"):
        for i in range(5):
            try:
                raise RuntimeError(f"boom {i}")
            except RuntimeError:
                failures.record("step", "the remote draft step")
    assert counters == {"failures": 5, "failures.step": 5}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.exc_info[1].args[0] for r in errors] == ["boom 0", "boom 1"]
    assert errors[0].getMessage() == "k3-accel: the remote draft step failed; this step gets no drafts"
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 3


def test_a_failure_outside_an_except_block_logs_no_empty_traceback(caplog):
    """The GPU deadline's failure has no exception: its log line carries no "NoneType: None"."""
    failures = FailureLog(collections.Counter())
    with caplog.at_level(logging.DEBUG, logger="k3_accel.vllm"):
        failures.record("deadline", "delivering step 2's drafts within 100 ms")
    (rec,) = caplog.records
    assert rec.levelno == logging.ERROR and not rec.exc_info and "NoneType" not in caplog.text


def test_a_drafter_without_a_session_drafts_nothing_and_builds_nothing():
    drafter = RemoteDrafter("cpu")

    def build(keep, fresh):
        raise AssertionError("no session: nothing to build")

    out = drafter.step(["a", "b"], skip=np.array([False, True]), k=3, build=build, pad_to=4)
    assert out.tolist() == [[-1] * 3] * 4 and out.dtype == torch.int64
    assert drafter.counters["skipped_requests"] == 1 and not drafter.counters["steps"]
    assert drafter.stats() == {"adapter": {"skipped_requests": 1, "known_requests": 0}}
    drafter.close()
    drafter.close()                                  # idempotent


def test_a_free_whose_adapter_rows_cannot_be_dropped_is_counted_and_still_sent():
    """``free_departed`` runs in the step (V2: the driver only drops its held rows, ``on_free``): a
    failure there must not raise into vLLM (the driver alone would leave the step while the other TP
    ranks wait in the drafts' broadcast); it is counted, and the free still reaches the server."""
    class Session:                                   # the draft session's free (the server's side is not tested here)
        def __init__(self):
            self.freed = []

        def finish(self, req_ids):
            self.freed.append(list(req_ids))

        def close(self):
            pass

    def on_free(req_ids):
        raise RuntimeError("planted: the held rows could not be dropped")

    drafter = RemoteDrafter("cpu")
    drafter.session, drafter.on_free = Session(), on_free
    drafter.known.new(["a", "b"])
    drafter.free_departed({"b"})
    assert drafter.session.freed == [["a"]]
    assert drafter.counters["failures.free"] == 1 and drafter.known.ids == {"b"}
