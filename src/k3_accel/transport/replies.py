"""A propose reply's drafts (and logits, confidence, ...) into the step's output, in input order.

Draft ids outside the target's vocabulary become "no draft" for their request
(counted; logged once per client); a reply of the wrong shape fails its
requests (a message failure).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from k3_accel.protocol import Reply
from k3_accel.transport.api import StepInput, StepOutput
from k3_accel.transport.failures import FailureKind, FailureQueue
from k3_accel.transport.timing import Telemetry

log = logging.getLogger("k3_accel.transport")


PER_DRAFT = ("drafts", "confidence", "logits", "topk_values", "topk_indices")   # [n, k, ...] each


def _fits(name: str, t: torch.Tensor, n: int, k: int) -> bool:
    """Whether reply tensor ``name`` has a row per proposing request (and, per draft, a column per draft)."""
    if name == "drafts":
        return tuple(t.shape) == (n, k)
    if name in PER_DRAFT:
        return tuple(t.shape[:2]) == (n, k)
    return t.dim() >= 1 and t.shape[0] == n           # one this client does not know: kept if per request


class ReplyReader:
    def __init__(self, address: str, vocab: int, failures: FailureQueue, telemetry: Telemetry):
        self.address, self.vocab = address, vocab
        self.failures, self.telemetry = failures, telemetry
        self._logged_vocab = False

    def fill(self, inp: StepInput, out: StepOutput, rows: np.ndarray, reply: Reply) -> None:
        """Rows ``rows`` of ``out`` (the proposing requests, in reply order) from ``reply``."""
        drafts = reply.tensors.get("drafts") if reply.ok else None
        if drafts is None:
            return
        wrong = next((name for name, t in reply.tensors.items()
                      if name in PER_DRAFT and not _fits(name, t, len(rows), inp.k)), None)
        if wrong is not None:
            self.failures.push(FailureKind.MESSAGE, [inp.req_ids[i] for i in rows.tolist()],
                               f"{wrong} shape {list(reply.tensors[wrong].shape)} != [{len(rows)}, {inp.k}, ...]")
            return
        d = drafts.numpy()
        vocab = self.vocab
        bad = ((d < -1) | (d >= vocab)).any(axis=1) if vocab else (d < -1).any(axis=1)
        if bad.any():
            d = d.copy()
            d[bad] = -1
            self._out_of_vocab(int(bad.sum()))
        out.drafts.numpy()[rows] = d
        if len(reply.tensors) > 1:
            index = torch.from_numpy(rows)
            for name, t in reply.tensors.items():
                if name != "drafts" and _fits(name, t, len(rows), inp.k):
                    full = torch.zeros((inp.num_requests, *t.shape[1:]), dtype=t.dtype)
                    full[index] = t
                    if name == "logits":
                        out.logits = full
                    else:
                        out.extra[name] = full

    def _out_of_vocab(self, n: int) -> None:
        self.telemetry.count("out_of_vocab_drafts", n)
        if not self._logged_vocab:
            self._logged_vocab = True
            log.error("k3 draft server %s sent draft ids outside the target's vocabulary (0..%d); those "
                      "requests get no drafts (counted as out_of_vocab_drafts)", self.address, self.vocab - 1)
