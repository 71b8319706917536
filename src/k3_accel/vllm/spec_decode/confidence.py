"""Per-draft confidence for vLLM's adaptive verification: a DSpark server's, or the controller's.

vLLM 0.33's V2 runner reads ``speculator.draft_token_confidence_probs`` (``[max_reqs, K]``
float32, batch order) after each propose when ``enable_adaptive_verification`` is on, and
sizes each request's verification budget from it. In-tree, DSpark with a confidence head
writes ``sigmoid(confidence_head(...))`` there; a remote DSpark server sends the same values
as the reply tensor ``confidence`` (the client puts it in ``StepOutput.extra``, the draft
thread in :attr:`DraftPipeline.confidence`). Without one, the adaptive controller puts its
measured acceptance per position there (:meth:`~.controller.Controller._confidence`; probes
excepted). This module turns that into the runner's buffer: the value where there is one, 1
where a draft came without one, 0 where there is no draft (such a position is not verified).
"""
from __future__ import annotations

from typing import Any

import torch

NONE = -1.0          # "the server sent no confidence here" in the pipeline's reply buffer


def wanted(spec: Any) -> bool:
    """Whether this target reads confidence from the reply: vLLM's adaptive verification is on."""
    return bool(getattr(spec, "enable_adaptive_verification", False))


def fill(probs: torch.Tensor, drafts: torch.Tensor, server: torch.Tensor | None = None) -> None:
    """``probs [r, k]`` from ``drafts [r, k]`` (-1 = none) and the server's confidence (or None);
    device-side, no host synchronisation."""
    if server is None:
        torch.ge(drafts, 0, out=probs)
        return
    given = torch.where(server >= 0, server, torch.ones_like(server))
    probs.copy_(torch.where(drafts >= 0, given, torch.zeros_like(given)))
