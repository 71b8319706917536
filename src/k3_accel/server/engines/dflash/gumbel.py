"""Seeded Gumbel-max draft sampling, keyed exactly as vLLM 0.33 keys a drafted token.

vLLM 0.33 samples a draft (``draft_sample_method: probabilistic``; for DSpark in
``DSparkSpeculator._sample_logits``) with ``gumbel_sample(..., is_drafting=True)`` and a
logits cache, which fixes every input of the noise:

* request seed ``s`` (vLLM's per-request seed; a request without one gets a random one),
  mixed with the draft step ``i``: ``s ^ (i << 32)``;
* position ``p``: the position *before* the predicted token, plus the draft salt ``2**30``
  (the target's own draws never use it); for draft ``i`` of a request whose anchor sits at
  context length ``L``, ``p = L + i + 2**30`` (both DSpark layouts);
* key: the token's id in the *target* vocabulary (a reduced draft vocabulary is scattered
  into the target's first).

The uniform is a 32-bit MurmurHash3 of ``(seed low, seed high, position, key)`` turned into
``(h + 0.5) * 2**-32`` in float32; the noise is ``-log(-log1p(-u))`` with ``log1p`` computed
as vLLM does (a degree-8 series below 0.25, else ``log(1 - u)``); the sample is
``argmax(logits / temperature + noise)``, or ``argmax(logits)`` at temperature 0.

:func:`sample` is the PyTorch version (any device; uint32 arithmetic on int64 tensors).
``ops_triton.gumbel_argmax`` is the same in one Triton pass for the CUDA-graph path.
"""
from __future__ import annotations

import torch

SALT = 1 << 30                   # draft draws are disjoint from the target's
MASK = 0xFFFFFFFF
C1, C2 = 0xCC9E2D51, 0x1B873593  # MurmurHash3 x86_32 constants
F1, F2 = 0x85EBCA6B, 0xC2B2AE35
MIX_ADD = 0xE6546B64


def step_seeds(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """The seed of draft step ``step`` (int64)."""
    return seeds ^ (step << 32)


def _mul(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for ``a`` in [0, 2**32) held in int64, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & MASK


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & MASK


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul(_rotl(_mul(key, C1), 15), C2)
    return (_mul(_rotl(h ^ key, 13), 5) + MIX_ADD) & MASK


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul(h, F1)
    h = h ^ (h >> 13)
    h = _mul(h, F2)
    return h ^ (h >> 16)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` float32 uniforms in (0, 1) for ``seeds [R]`` int64, ``positions [R]`` int64
    (salt included) and ``keys [V]`` (target token ids)."""
    h = torch.zeros_like(seeds)
    h = _mix(h, seeds & MASK)
    h = _mix(h, (seeds >> 32) & MASK)
    h = _mix(h, positions & MASK)
    h = _fmix(_mix(h[:, None], (keys.to(torch.int64) & MASK)[None, :]) ^ 16)
    hi, lo = (h >> 16).to(torch.float32), (h & 0xFFFF).to(torch.float32)
    return hi * 1.52587890625e-05 + (lo + 0.5) * 2.3283064365386963e-10


def _log1p_neg(u: torch.Tensor) -> torch.Tensor:
    """``log(1 - u)`` in float32 the way vLLM computes it (Horner series below 0.25)."""
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        poly = c + u * poly
    direct = torch.log(torch.clamp_min(1.0 - u, 5.960464477539063e-08))
    return torch.where(u < 0.25, -u * poly, direct)


def noise(seeds: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``[R, V]`` float32."""
    return -torch.log(-_log1p_neg(uniform(seeds, positions, keys)))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           keys: torch.Tensor | None = None) -> torch.Tensor:
    """Sampled indices ``[R]`` (int64, into ``logits``' columns) of ``logits [R, V]``:
    ``argmax(logits / t + noise)`` per row, plain argmax where ``t`` is 0. ``keys [V]``: each
    column's target id (None: the column index). ``seeds`` already mixed with the step
    (:func:`step_seeds`), ``positions`` salted (see the module docstring)."""
    x = logits.float()
    if keys is None:
        keys = torch.arange(x.shape[-1], device=x.device)
    t = temperature.to(x.device, torch.float32)[:, None]
    hot = t != 0
    noised = torch.where(hot, x / torch.where(hot, t, torch.ones_like(t)) + noise(seeds, positions, keys), x)
    return noised.argmax(dim=-1)
