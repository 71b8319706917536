"""The V1 runner's token-only drafting (``method: "ngram"``): the step from the runner's CPU
state, and the drafts back as the lists ``NgramProposer.propose`` returns.

Pure numpy / torch code (no vLLM import), so it is unit-tested on its own.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput


def token_step(req_ids: Sequence[str], rows: Sequence[int], *, computed: np.ndarray, scheduled: np.ndarray,
               num_tokens: np.ndarray, token_ids: np.ndarray, sampled: Sequence[bool], k: int,
               prompts: Mapping[str, Any] | None = None) -> StepInput:
    """The step input for token-only drafting (no hidden rows), from the runner's CPU state.

    ``req_ids[j]`` is batch row ``rows[j]``. Per row: ``computed`` tokens were
    done before this step, ``scheduled`` were scheduled in it and
    ``token_ids[row, :num_tokens]`` are known now (a request that sampled
    ends with its new token). A request that sampled ships rows
    ``computed .. num_tokens - 1`` (the rest of what it verified) and anchors
    on its last token; a mid-prefill one ships its chunk and anchors on the
    next prompt token.
    """
    counts, pos, toks, anchors, anchor_pos = [], [], [], [], []
    for row, did_sample in zip(rows, sampled):
        start = int(computed[row])
        end = int(num_tokens[row]) - 1 if did_sample else start + int(scheduled[row])
        counts.append(end - start)
        pos.append(np.arange(start, end, dtype=np.int64))
        toks.append(np.asarray(token_ids[row, start:end], dtype=np.int64))
        anchors.append(int(token_ids[row, end]))
        anchor_pos.append(end)
    cat = (lambda parts: torch.from_numpy(np.concatenate(parts)) if parts
           else torch.empty(0, dtype=torch.int64))
    return StepInput(req_ids=list(req_ids), counts=counts, positions=cat(pos), token_ids=cat(toks),
                     sampled=[bool(s) for s in sampled], anchor_tokens=anchors, anchor_positions=anchor_pos,
                     k=k, prompt_token_ids=dict(prompts) if prompts else None)


def draft_lists(drafts: torch.Tensor) -> list[list[int]]:
    """Per-request draft lists, each cut at its first -1 (no draft)."""
    out = []
    for row in drafts.tolist():
        cut = row.index(-1) if -1 in row else len(row)
        out.append(row[:cut])
    return out
