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


def warm_budget(device: torch.device, max_num_reqs: int, k: int) -> int:
    """Compile vLLM's adaptive-verification slot ranking now, at engine start, for the shapes a
    step gives it; returns the calls made (0: this vLLM has no such function).

    vLLM 0.33 ranks draft slots with ``_assign_draft_token_budget_compiled``
    (``torch.compile(dynamic=True)``) only in a step whose budget binds (fewer slots than drafts),
    so it compiles inside the first such step: a 0.6-1.2 s stall of the engine (P6 on the H200
    and the H100), and again for the first batch of one request (dynamic shapes specialise sizes
    0 and 1). Called from the speculator's ``capture`` (vLLM's graph capture, before serving),
    with the runtime's dtypes: confidences float32 ``[max_num_reqs, k]``, slot mapping int64,
    capacities int32, under inference mode as the runner calls it."""
    try:
        from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av
        rank = av._assign_draft_token_budget_compiled
    except (ImportError, AttributeError):
        return 0
    calls = 0
    with torch.inference_mode():
        probs = torch.ones((max_num_reqs, k), dtype=torch.float32, device=device)
        for reqs in (2, 1):
            for budget in (2, 1):
                if reqs > max_num_reqs or budget >= reqs * k:     # the runner ranks only a budget that binds
                    continue
                capacities = torch.full((reqs,), k, dtype=torch.int32, device=device)
                rank(probs, torch.arange(reqs, dtype=torch.int64, device=device), capacities, budget, k)
                calls += 1
    return calls

