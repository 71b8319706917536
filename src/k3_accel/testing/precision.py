"""What a drafting engine guarantees about its numbers, as test rules.

Logits of an engine in dtype ``d`` may differ from a float64 reference by
``tolerance = ROUNDINGS[d] * u(d) * max|reference logit of the row|``, where
``u`` is the dtype's unit roundoff (2^-8 for bfloat16, 2^-11 for float16,
2^-24 for float32). The budgets: low-precision errors come from a handful of
activation roundings (the matrix products accumulate in fp32): 8 roundings,
about three times the worst seen on the tiny test drafts (2.5); float32 errors
come from accumulation over long dot products and grow with the length of the
sums (10 seen): 256.

A draft can only differ from the reference's argmax where the reference's
top-1 margin is at most twice the tolerance (each of the two logits may move
by the tolerance); everywhere else the tokens must be equal. Nothing here
depends on one machine's rounding or tie-breaking.
"""
from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
ROUNDINGS = {torch.float32: 256, torch.bfloat16: 8, torch.float16: 8}


def logit_tolerance(dtype: torch.dtype, reference: torch.Tensor) -> torch.Tensor:
    """Per-row tolerance ``[..., 1]`` for logits ``reference [..., V]`` (-inf entries ignored)."""
    finite = torch.where(torch.isfinite(reference), reference.abs(), torch.zeros_like(reference))
    return ROUNDINGS[dtype] * UNIT_ROUNDOFF[dtype] * finite.amax(-1, keepdim=True)


def clear_positions(reference: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    """Rows whose top-1 margin exceeds twice the tolerance (argmax cannot flip)."""
    top2 = reference.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]) > 2 * tolerance[..., 0]


def check_logits(logits: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """Every finite logit within tolerance; -inf exactly where the reference has it."""
    ref = reference.double()
    got = logits.double()
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "finite entries differ"
    tol = logit_tolerance(dtype, ref)
    err = torch.where(torch.isfinite(ref), (got - ref).abs(), torch.zeros_like(ref))
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"logits off by {worst:.2f}x the {dtype} tolerance"


def check_drafts(tokens: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> int:
    """Tokens equal the reference's argmax at every clear position; returns how many
    positions were clear (callers assert it is not vacuous)."""
    ref = reference.double()
    clear = clear_positions(ref, logit_tolerance(dtype, ref))
    want = ref.argmax(-1)
    bad = clear & (tokens.to(want.device) != want)
    assert not bool(bad.any()), f"drafts differ at clear positions {bad.nonzero().tolist()}"
    return int(clear.sum())
