"""A benchmark-only DFlash engine whose acceptance is fixed by construction (issue 27, P6).

:class:`OracleDFlashEngine` is a :class:`~k3_accel.server.engines.dflash.DFlashEngine`: every
ingest and every propose runs the DFlash engine's full compute (context projection, K/V scatter,
the block forward, CUDA-graph replay, the device argmax). Then, instead of the draft model's
tokens, it proposes the target's own greedy continuation, recorded in a first pass without
speculation, correct up to a prefix length drawn per request and step so that draft position
``i`` is accepted with vLLM's unconditional rate ``rates[i]`` (``_acceptance_length_to_rates``:
the minimum-variance schedule for a mean acceptance length). After that prefix every draft is
wrong on purpose, so verification rejects it. What is measured is then the system (transport,
server, engine, verification), not a model.

Control: a JSON file ``{"length": L, "record": PATH, "seed": S}`` read again whenever its mtime
changes (one ``os.stat`` per propose), so one server serves several acceptance lengths and
batch sizes; on each change the last setting's counts (requests, found in the record, drafts
scheduled right) are appended to ``CONTROL.counts.jsonl``. The record is ``{"sequences": [[prompt + greedy output ids], ...]}``; a request is
found by its first ``KEY`` context ids. Not part of the product: it lives under ``benchmarks/``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from k3_accel.server.engines.base import Proposal, ProposeBatch
from k3_accel.server.engines.dflash import DFlashEngine

KEY = 8            # context ids that identify a recorded sequence


def acceptance_rates(length: float, n: int) -> list[float]:
    """vLLM 0.33's ``SpeculativeConfig._acceptance_length_to_rates`` (vllm/config/speculative.py):
    the unconditional per-position rates of the minimum-variance schedule for a mean acceptance
    length ``length`` (1 + expected accepted drafts) over ``n`` positions. Copied so that the
    draft server needs no vLLM; ``tests/test_oracle_engine.py`` checks it against vLLM's."""
    if not 1.0 <= length <= n + 1:
        raise ValueError(f"acceptance length must be in [1, {n + 1}], got {length}")
    num_drafts = length - 1
    num_full = int(num_drafts)
    return ([1.0] * num_full + [num_drafts - num_full] + [0.0] * (n - num_full - 1))[:n]


class Oracle:
    """The schedule and the recorded continuations; :meth:`drafts` makes one request's drafts."""

    def __init__(self, length: float, sequences: Sequence[Sequence[int]], vocab_size: int, seed: int = 0):
        self.length, self.vocab_size = float(length), vocab_size
        self.rng = np.random.default_rng(seed)
        self.sequences = {tuple(s[:KEY]): list(s) for s in sequences if len(s) > KEY}
        self.counts = {"requests": 0, "found": 0, "scheduled_accepts": 0}

    @classmethod
    def from_control(cls, ctl: dict, vocab_size: int) -> "Oracle":
        seqs = json.loads(Path(ctl["record"]).read_text())["sequences"] if ctl.get("record") else []
        return cls(ctl["length"], seqs, vocab_size, int(ctl.get("seed", 0)))

    def prefix(self, k: int) -> int:
        """How many leading drafts are right this time: P(prefix >= i + 1) = rates[i]."""
        u = self.rng.random()
        return sum(u < r for r in acceptance_rates(self.length, k))

    def drafts(self, history: Sequence[int], anchor: int, k: int) -> list[int] | None:
        """``k`` drafts after ``anchor`` at position ``len(history)``, or None when the request
        is not in the record (then the DFlash drafts stand)."""
        self.counts["requests"] += 1
        seq = self.sequences.get(tuple(int(t) for t in history[:KEY]))
        pos = len(history)
        if seq is None or pos >= len(seq) or seq[pos] != anchor:
            return None
        self.counts["found"] += 1
        truth = seq[pos + 1:pos + 1 + k]
        truth += [(anchor + 1 + j) % self.vocab_size for j in range(k - len(truth))]
        n = self.prefix(k)
        self.counts["scheduled_accepts"] += n
        return truth[:n] + [(t + 1) % self.vocab_size for t in truth[n:]]


def write_control(path: str | Path, control: dict) -> None:
    """Replace the control file at once: the server may read it in the middle of a write."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(control))
    os.replace(tmp, path)


class OracleDFlashEngine(DFlashEngine):
    """DFlash compute, the recorded continuation as drafts (see the module docstring).

    ``control``: the control file's path. ``last_compute`` keeps the DFlash engine's own
    proposal of the latest step (what the compute produced), for tests.
    """

    def _build(self, weights: Any, *, control: str | None = None, **options: Any) -> None:
        super()._build(weights, **options)
        self.control, self._mtime, self._record, self._tag = control, None, None, None
        self.oracle = Oracle(1.0, [], self.config.vocab_size)
        self.last_compute: Proposal | None = None

    def _reload(self) -> None:
        if self.control is None:
            return
        mtime = os.stat(self.control).st_mtime_ns
        if mtime != self._mtime:
            if self._mtime is not None:       # what the last setting proposed, for the benchmark
                with open(f"{self.control}.counts.jsonl", "a") as fh:
                    fh.write(json.dumps({"length": self.oracle.length, "record": self._record,
                                         "tag": self._tag, **self.oracle.counts}) + "\n")
            control = json.loads(Path(self.control).read_text())
            self.oracle = Oracle.from_control(control, self.config.vocab_size)
            self._record, self._tag = control.get("record"), control.get("tag")
            self._mtime = mtime

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Proposal:
        computed = super().propose(batch)          # the DFlash engine's full step
        self.last_compute = computed
        r, k = len(batch.states), batch.k
        if r == 0 or k == 0:
            return computed
        self._reload()
        anchors = batch.anchors.reshape(-1).tolist()
        rows = [self.oracle.drafts(batch.histories[i], anchors[i], k) for i in range(r)]
        if any(row is None for row in rows):
            computed.wait()                        # keep the DFlash drafts of unknown requests
            tokens = computed.tokens.clone()
        else:
            tokens = torch.empty(r, k, dtype=torch.long)
        for i, row in enumerate(rows):
            if row is not None:
                tokens[i] = torch.tensor(row, dtype=torch.long)
        return Proposal(tokens, logits=computed.logits, topk_values=computed.topk_values,
                        topk_indices=computed.topk_indices, ready=computed.ready)

    def oracle_counts(self) -> dict[str, int]:
        return dict(self.oracle.counts)
