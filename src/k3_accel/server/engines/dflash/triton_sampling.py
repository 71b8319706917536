"""Picking a draft on the device, as Triton kernels: the argmax of a row (optionally of a sum, as
DSpark's greedy Markov step needs), the seeded Gumbel-max sample of :mod:`.gumbel`, and DSpark's
whole Markov step fused (:func:`markov_pick`: the bias GEMM, the sum and the pick in one pass over
the bias weights). Same numerics as :mod:`.ops_torch`; part of the :mod:`.ops_triton` backend.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gumbel import SALT

# ------------------------------------------------------------------ argmax ---

@triton.jit
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, n_cols, x_stride, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * BLOCK + where)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P2)
    vals = tl.load(val_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * n_chunks + first).to(tl.int64))


def _chunk_maxima(n: int, chunks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk maxima and their column indices ``[n, chunks]``, filled by a chunks kernel."""
    return (torch.empty(n, chunks, dtype=torch.float32, device=device),
            torch.empty(n, chunks, dtype=torch.int32, device=device))


def _first_max(vals: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [n]``: each row's column of its first maximum, from its per-chunk maxima."""
    n, chunks = vals.shape
    _argmax_rows_kernel[(n,)](vals, idx, out, chunks, CHUNKS_P2=max(2, triton.next_power_of_2(chunks)), num_warps=1)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of ``x [N, V]`` (int64), in two passes: per-chunk
    maxima over the whole device, then one small pass per row."""
    n, cols = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n:
        block = min(8192, triton.next_power_of_2(cols))
        chunks = triton.cdiv(cols, block)
        vals, idx = _chunk_maxima(n, chunks, x.device)
        _argmax_chunks_kernel[(n, chunks)](x, vals, idx, cols, x.stride(0), chunks, BLOCK=block, num_warps=8)
        _first_max(vals, idx, out)
    return out


# ------------------------------------------------------- seeded Gumbel-max ---
# The draft sample of :mod:`.gumbel` (vLLM 0.33's keying) in one pass over the logits.

@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _murmur_mix(h, key):
    key = _rotl32(key * 0xCC9E2D51, 15) * 0x1B873593
    return _rotl32(h ^ key, 13) * 5 + 0xE6546B64


@triton.jit
def _murmur_fmix(h):
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel_noised(x, t, seed, pos, keys):
    """``x / t + noise`` of :mod:`.gumbel` for rows ``[R, 1]`` (t, seed, pos) and keys ``[1, C]``;
    ``x`` where t is 0."""
    h = (seed * 0).to(tl.uint32)
    h = _murmur_mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur_mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur_mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur_fmix(_murmur_mix(h, keys.to(tl.uint32)) ^ 16)
    u = (h >> 16).to(tl.int32).to(tl.float32) * 1.52587890625e-05 \
        + ((h & 0xFFFF).to(tl.int32).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    poly = 1.0 / 8.0
    poly = 1.0 / 7.0 + u * poly
    poly = 1.0 / 6.0 + u * poly
    poly = 1.0 / 5.0 + u * poly
    poly = 1.0 / 4.0 + u * poly
    poly = 1.0 / 3.0 + u * poly
    poly = 1.0 / 2.0 + u * poly
    poly = 1.0 + u * poly
    log1p_neg = tl.where(u < 0.25, -u * poly, tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08)))
    hot = t != 0.0
    return tl.where(hot, x / tl.where(hot, t, 1.0) - tl.log(-log1p_neg), x)


@triton.jit(do_not_specialize=["step"])
def _gumbel_chunks_kernel(x_ptr, t_ptr, seed_ptr, len_ptr, key_ptr, val_ptr, idx_ptr, step, n_cols,
                          x_stride, n_chunks, SALT: tl.constexpr, HAS_KEYS: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
    t = tl.load(t_ptr + row)
    if t != 0.0:
        seed = tl.load(seed_ptr + row) ^ (tl.cast(step, tl.int64) << 32)
        pos = tl.load(len_ptr + row).to(tl.int64) + step + SALT
        if HAS_KEYS:
            keys = tl.load(key_ptr + cols, mask=ok, other=0)
        else:
            keys = cols
        x = tl.where(ok, _gumbel_noised(x, t, seed, pos, keys), float("-inf"))
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * BLOCK + where)


def gumbel_argmax(x: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, ctx_lens: torch.Tensor,
                  step: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.gumbel.sample` of draft step ``step`` (seeds and positions derived here):
    indices ``[N]`` int64 into the columns of ``x [N, V]``."""
    n, cols = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n:
        block = min(4096, triton.next_power_of_2(cols))
        chunks = triton.cdiv(cols, block)
        vals, idx = _chunk_maxima(n, chunks, x.device)
        _gumbel_chunks_kernel[(n, chunks)](x, temperature, seeds, ctx_lens, x if keys is None else keys, vals,
                                           idx, step, cols, x.stride(0), chunks, SALT=SALT,
                                           HAS_KEYS=keys is not None, BLOCK=block, num_warps=8)
        _first_max(vals, idx, out)
    return out


# ------------------------------------------------------ DSpark's Markov step ---
# ``pick(base + (w1[prev] @ w2.T) * scale)``: the bias is rounded to the dtype as F.linear stores it,
# its scaled value and the sum as PyTorch would store them; nothing [R, V] is stored.
# Persistent: a few programs per SM (TILE: columns per block, warps, pipeline stages, programs per
# SM), each with up to 64 requests, walk the column blocks ``pid, pid + programs, ..``: the
# gathered ``w1`` rows are loaded once per program, the next blocks' ``w2`` loads are in flight while
# a block is picked (its noise drawn), and each program folds its rows' best into the running
# maximum it keeps, then into one int64 per row with one atomic max (the value's ordered bits above,
# the column's complement below: the first column wins a tie, as torch.argmax picks). The next step
# reads its previous token from there: a step is one launch. WALK_BACK: odd steps take the column
# blocks from the last, so the blocks of ``w2`` the previous step read last may still be in L2.
# Programs whose rows all draft greedily draw no noise. TILE as benchmarks/markov_step.py measured
# it (an H100, B = 32, a step: 34.1 us greedy and 39.1 sampled, against 34.1 and 47.2 for the
# kernel of one program per column block).
TILE = (32, 4, 3, 4)
WALK_BACK = True
_UNSET = -2**63                       # below every packed value
_LOW = tl.constexpr(2**31 - 1)        # packed low half: _LOW - column
_RANK_CHUNK = 256                     # rank per dot; a wider rank reloads its w1 rows per block
_STAGED_BYTES = 2**17                 # at most this much of w in flight per program (shared memory)


@triton.jit
def _column(packed):
    """The column of a packed pick (its low half holds ``_LOW - column``)."""
    return _LOW - (packed - ((packed >> 32) << 32))


@triton.jit(do_not_specialize=["step", "flip"])
def _markov_kernel(base_ptr, prev_ptr, d2t_ptr, table_ptr, w_ptr, t_ptr, seed_ptr, len_ptr, key_ptr, best_ptr,
                   step, flip, n_rows, n_cols, base_stride, n_chunks, n_programs, prev_stride, scale,
                   ROWS: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                   PACKED_PREV: tl.constexpr, HAS_D2T: tl.constexpr, SCALED: tl.constexpr,
                   SAMPLED: tl.constexpr, HAS_KEYS: tl.constexpr, IEEE: tl.constexpr, SALT: tl.constexpr):
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    prev = tl.load(prev_ptr + rows * prev_stride, mask=row_ok, other=0).to(tl.int64)
    if PACKED_PREV:                  # the previous step's packed best: its column, as a target id
        prev = _column(prev)
        if HAS_D2T:
            prev += tl.load(d2t_ptr + prev, mask=row_ok, other=0).to(tl.int64)
    ks0 = tl.arange(0, BK)
    e0 = tl.load(table_ptr + prev[:, None] * RANK + ks0[None, :], mask=row_ok[:, None] & (ks0 < RANK)[None, :],
                 other=0.0)
    if SAMPLED:
        t = tl.load(t_ptr + rows, mask=row_ok, other=0.0)[:, None]
        seed = tl.load(seed_ptr + rows, mask=row_ok, other=0)[:, None] ^ (tl.cast(step, tl.int64) << 32)
        pos = tl.load(len_ptr + rows, mask=row_ok, other=0).to(tl.int64)[:, None] + step + SALT
        hot = tl.max((t != 0.0).to(tl.int32)) != 0      # no noise for rows that all draft greedily
    dt = base_ptr.dtype.element_ty
    best = tl.full([ROWS], -2**63, dtype=tl.int64)
    for c in range(tl.program_id(0), n_chunks, n_programs):
        chunk = c + flip * (n_chunks - 1 - 2 * c)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < n_cols
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for k0 in tl.static_range(0, RANK, BK):
            ks = k0 + ks0
            k_ok = ks < RANK
            if k0 == 0:
                e = e0
            else:
                e = tl.load(table_ptr + prev[:, None] * RANK + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0.0)
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * RANK + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(e, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(e, tl.trans(w), acc)
        y = acc.to(dt)
        if SCALED:
            y = (y.to(tl.float32) * scale).to(dt)
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(base_ptr + rows[:, None].to(tl.int64) * base_stride + cols[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(dt).to(tl.float32)
        if SAMPLED:
            if hot:
                if HAS_KEYS:
                    keys = tl.load(key_ptr + cols, mask=col_ok, other=0)[None, :]
                else:
                    keys = cols[None, :]
                x = _gumbel_noised(x, t, seed, pos, keys)
        x = tl.where(ok, x, float("-inf"))
        x = tl.where(x == 0.0, 0.0, x)                   # -0.0 ties +0.0, as in torch.argmax
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ordered as the floats are
        packed = (bits.to(tl.int64) << 32) + (_LOW - cols[None, :].to(tl.int64))
        best = tl.maximum(best, tl.max(packed, axis=1))
    tl.atomic_max(best_ptr + rows, best, mask=row_ok)


def _unpack(best: torch.Tensor) -> torch.Tensor:
    """Columns (int64) of packed maxima."""
    return _LOW.value - (best & 0xFFFFFFFF)


def _markov_step(base: torch.Tensor, prev: torch.Tensor, packed_prev: bool, table: torch.Tensor,
                 w: torch.Tensor, scale: float, best: torch.Tensor, d2t: torch.Tensor | None,
                 temperature: torch.Tensor | None, seeds: torch.Tensor | None,
                 ctx_lens: torch.Tensor | None, step: int, keys: torch.Tensor | None) -> None:
    """One launch: ``best [R]`` (contiguous, filled with _UNSET) gets each row's packed pick of
    ``base [R, V] + (table[prev] @ w.T) * scale``."""
    n, cols = base.shape
    rank = w.shape[1]
    block, warps, stages, per_sm = TILE
    bk = min(_RANK_CHUNK, max(16, triton.next_power_of_2(rank)))   # rank per dot (masked past the rank)
    while block > 16 and stages * block * triton.cdiv(rank, bk) * bk * w.element_size() > _STAGED_BYTES:
        block //= 2                           # the staged blocks of w fit in shared memory
    rows = min(64, max(16, triton.next_power_of_2(n)))    # requests per program (tl.dot: >= 16)
    chunks = triton.cdiv(cols, block)
    programs = min(chunks, per_sm * _processors(base.device))
    sampled = temperature is not None
    _markov_kernel[(programs, triton.cdiv(n, rows))](
        base, prev, best if d2t is None else d2t, table, w, temperature if sampled else best,
        seeds if sampled else best, ctx_lens if sampled else best, base if keys is None else keys, best,
        step, step % 2 if WALK_BACK else 0, n, cols, base.stride(0), chunks, programs, prev.stride(0),
        float(scale), ROWS=rows,
        RANK=rank, BLOCK=block, BK=bk, PACKED_PREV=packed_prev, HAS_D2T=d2t is not None,
        SCALED=scale != 1.0, SAMPLED=sampled, HAS_KEYS=keys is not None,
        IEEE=base.dtype == torch.float32, SALT=SALT, num_warps=warps, num_stages=stages)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 2 elsewhere (the interpreter: a program walks
    several column blocks)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 2


def markov_pick(base: torch.Tensor, e: torch.Tensor, w: torch.Tensor, scale: float,
                temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                ctx_lens: torch.Tensor | None = None, step: int = 0,
                keys: torch.Tensor | None = None) -> torch.Tensor:
    """One step of DSpark's Markov head: indices ``[R]`` (int64, draft vocabulary) of
    ``base [R, V] + (e [R, r] @ w [V, r].T) * scale``: the argmax, or with ``temperature`` the
    seeded sample of draft ``step`` (:func:`gumbel_argmax`'s keying)."""
    n = base.shape[0]
    best = torch.full((n,), _UNSET, dtype=torch.int64, device=base.device)
    if n:
        _markov_step(base, torch.arange(n, device=base.device), False, e.contiguous(), w.contiguous(), scale,
                     best, None, temperature, seeds, ctx_lens, step, keys)
    return _unpack(best)


def markov_drafts(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  scale: float, d2t: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                  seeds: torch.Tensor | None = None, ctx_lens: torch.Tensor | None = None,
                  keys: torch.Tensor | None = None) -> torch.Tensor:
    """DSpark's Markov head over ``base [R, k, V]`` from ``anchors [R]`` (target ids): target ids
    ``[R, k]`` (int64), ``k`` launches (:func:`markov_pick` at each step, ``e = w1[prev]``,
    ``prev`` the last draft mapped by ``d2t``)."""
    r, k, _ = base.shape
    best = torch.full((k, r), _UNSET, dtype=torch.int64, device=base.device)
    ids = torch.empty(r, k, dtype=torch.int64, device=base.device)
    if r * k:
        w1, w2 = w1.contiguous(), w2.contiguous()
        for i in range(k):
            _markov_step(base[:, i], anchors if i == 0 else best[i - 1], i > 0, w1, w2, scale, best[i], d2t,
                         temperature, seeds, ctx_lens, i, keys)
        n = r * k
        block = min(1024, triton.next_power_of_2(n))
        _drafts_kernel[(triton.cdiv(n, block),)](best, best if d2t is None else d2t, ids, n, r, k,
                                                 HAS_D2T=d2t is not None, BLOCK=block, num_warps=4)
    return ids


@triton.jit
def _drafts_kernel(best_ptr, d2t_ptr, ids_ptr, n, r, k, HAS_D2T: tl.constexpr, BLOCK: tl.constexpr):
    """``ids [R, k]``: the packed picks ``best [k, R]`` decoded (and mapped to target ids)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    packed = tl.load(best_ptr + (idx % k) * r + idx // k, mask=ok, other=0)
    col = _column(packed)
    if HAS_D2T:
        col += tl.load(d2t_ptr + col, mask=ok, other=0).to(tl.int64)
    tl.store(ids_ptr + idx, col, mask=ok)
