"""Per-draft confidence for vLLM's adaptive verification, from a DSpark server's reply.

vLLM 0.33's V2 runner reads ``speculator.draft_token_confidence_probs`` (``[max_reqs, K]``
float32, batch order) after each propose when ``enable_adaptive_verification`` is on, and
sizes each request's verification budget from it. In-tree, DSpark with a confidence head
writes ``sigmoid(confidence_head(...))`` there; a remote DSpark server sends the same values
as the reply tensor ``confidence`` (the client puts it in ``StepOutput.extra``, the draft
thread in :attr:`DraftPipeline.confidence`). This module turns that into the runner's buffer:
the server's value where it sent one, 1 where a draft came without one, 0 where there is no
draft (such a position is not verified at all).
"""
from __future__ import annotations

from typing import Any

import torch

NONE = -1.0          # "the server sent no confidence here" in the pipeline's reply buffer


def wanted(spec: Any) -> bool:
    """Whether this target uses server confidence: DSpark with adaptive verification."""
    return spec.method == "dspark" and bool(getattr(spec, "enable_adaptive_verification", False))


def fill(probs: torch.Tensor, drafts: torch.Tensor, server: torch.Tensor | None = None) -> None:
    """``probs [r, k]`` from ``drafts [r, k]`` (-1 = none) and the server's confidence (or None);
    device-side, no host synchronisation."""
    if server is None:
        torch.ge(drafts, 0, out=probs)
        return
    given = torch.where(server >= 0, server, torch.ones_like(server))
    probs.copy_(torch.where(drafts >= 0, given, torch.zeros_like(given)))
