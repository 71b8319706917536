"""Run by test_dflash_precision.py (and test_dflash_gpu.py) in a subprocess: the Triton
ops against the PyTorch ops, kernel by kernel and as a whole engine.

On the CPU it needs TRITON_INTERPRET=1 (float32); with ``--device cuda`` it runs
the compiled kernels in float32 and bfloat16. Prints "all kernels agree" at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from k3_accel.server.engines.dflash import ops_torch, ops_triton
from k3_accel.server.engines.dflash.config import DFlashConfig
from k3_accel.server.engines.dflash.model import rope_table
from k3_accel.server.engines.dflash import gumbel, triton_sampling
from k3_accel.testing.precision import UNIT_ROUNDOFF, clear_positions, logit_tolerance

CFG = DFlashConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=48, rms_norm_eps=1e-6, rope_theta=1e4, rotary_dim=16,
                   is_neox_style=True, max_position_embeddings=256, attention_bias=False,
                   vocab_size=100, draft_vocab_size=100, target_hidden_size=64, logit_scale=1.0,
                   mask_token_id=99, target_layer_ids=(0, 1), block_size=8, causal=False,
                   v_scale=None)


def close(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """Relative to the larger of 1 and the values' scale, within 8 roundings of ``dtype``
    (the two paths round intermediate values at different points)."""
    scale = max(1.0, want.float().abs().max().item())
    err = (got.float() - want.float()).abs().max().item() / scale
    bound = 8 * UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 1e-5
    assert err <= bound, f"{what} ({dtype}): relative error {err:.3g} > {bound:.3g}"


def kernels(device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x, r, w = rnd(5, 64), rnd(5, 64), (1 + 0.1 * torch.randn(64, generator=gen)).to(device, dtype)
    close(ops_triton.rms_norm(x, w, 1e-6), ops_torch.rms_norm(x, w, 1e-6), "rms_norm", dtype)
    for got, want in zip(ops_triton.add_rms_norm(x, r, w, 1e-6), ops_torch.add_rms_norm(x, r, w, 1e-6)):
        close(got, want, "add_rms_norm", dtype)
    for cols in (1000, 8192 * 2 + 5):
        logits = rnd(6, cols)
        logits[1, 17] = logits[1, cols - 3] = logits[1].max() + 1      # a tie: the first wins
        logits[2, cols - 1] = logits[2].max() + 1                      # in the last chunk
        assert torch.equal(ops_triton.argmax(logits), ops_torch.argmax(logits)), "argmax"
        assert int(ops_triton.argmax(logits)[1]) == 17
    markov(device, dtype, gen)
    markov_chain(device, dtype, gen)
    anchors = torch.tensor([7, 0, 99, 42, 5], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 13, 150, 64, 3], dtype=torch.int32, device=device)
    for rows in (1, 7, 8):
        for got, want in zip(ops_triton.block_inputs(anchors, starts, rows, 98),
                             ops_torch.block_inputs(anchors, starts, rows, 98)):
            assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), f"block_inputs rows={rows}"
    for with_markov in (True, False):                 # hidden past one block of the kernel's sum
        r, k, hidden, rank, vocab = 5, 4, 1100, 24, 120
        h, w1 = rnd(r * k, hidden), rnd(vocab, rank)
        ids = torch.randint(0, vocab, (r, k), generator=gen).to(device)
        w = (torch.randn(1, hidden + (rank if with_markov else 0), generator=gen) / 30).to(device)
        b = torch.randn(1, generator=gen).to(device)
        m = w1 if with_markov else None
        close(ops_triton.markov_confidence(h, anchors, ids, m, w, b),
              ops_torch.markov_confidence(h, anchors, ids, m, w, b), f"markov_confidence {with_markov}", torch.float32)
    if device == "cpu":     # seeded Gumbel-max: the interpreter computes as PyTorch does (CUDA: test_dspark_gpu)
        logits = torch.randn(6, 3000, generator=gen) * 3
        temps = torch.tensor([0.0, 0.7, 1.3, 2.0, 0.0, 1.0])
        seeds = torch.tensor([5, -3, 2**40 + 7, -(2**62), 0, 12345])
        lens = torch.tensor([0, 9, 100, 7000, 3, 1], dtype=torch.int32)
        for keys in (None, torch.arange(3000) * 3 + 1):
            for step in (0, 2):
                got = ops_triton.gumbel_argmax(logits, temps, seeds, lens, step, keys)
                assert torch.equal(got, ops_torch.gumbel_argmax(logits, temps, seeds, lens, step, keys)), "gumbel"
                assert torch.equal(got[temps == 0], logits[temps == 0].argmax(-1)), "gumbel at temperature 0"
    gu = rnd(5, 96)
    close(ops_triton.silu_mul(gu), ops_torch.silu_mul(gu), "silu_mul", dtype)
    for neox in (True, False):
        for rot in (16, 8):
            for v_scale in (None, 0.5):
                cfg = dataclasses.replace(CFG, is_neox_style=neox, rotary_dim=rot, v_scale=v_scale)
                cs = rope_table(cfg, 256, dtype, device)
                qkv, pos = rnd(6, 8 * 16), torch.tensor([0, 5, 17, 3, 200, 9], device=device)
                qw, kw = rnd(16) * 0.1 + 1, rnd(16) * 0.1 + 1
                for got, want in zip(ops_triton.qk_norm_rope(qkv.clone(), qw, kw, cs, pos, cfg),
                                     ops_torch.qk_norm_rope(qkv.clone(), qw, kw, cs, pos, cfg)):
                    close(got, want, f"qk_norm_rope neox={neox} rot={rot}", dtype)
                proj, kn = rnd(7, 2 * 2 * 2 * 16), rnd(2, 16) * 0.1 + 1
                slots = torch.tensor([3, 9, 10, 0, 31, 17, 22], device=device)
                pos = torch.tensor([1, 2, 3, 4, 50, 6, 7], device=device)
                kv1 = torch.zeros(2, 2, 4, 8, 2, 16, device=device, dtype=dtype)
                kv2 = kv1.clone()
                ops_torch.store_context(proj, kn, cs, pos, slots, kv1, cfg)
                ops_triton.store_context(proj, kn, cs, pos, slots, kv2, cfg)
                close(kv2, kv1, f"store_context neox={neox} rot={rot} v_scale={v_scale}", dtype)
    for causal in (False, True):
        cfg = dataclasses.replace(CFG, causal=causal)
        for rows in (2, 5, 8, 16):
            for splits in (1, 3, 7):
                kp, vp = rnd(100, 8, 2, 16), rnd(100, 8, 2, 16)
                lens = torch.tensor([0, 13, 150, 64], dtype=torch.int32, device=device)
                perm = torch.randperm(100, generator=gen)[:80]
                tables = perm.view(4, 20).to(device=device, dtype=torch.int32)
                qkv = rnd(4 * rows, 8 * 16)
                q, k, v = qkv[:, :64], qkv[:, 64:96], qkv[:, 96:]
                if splits == 3:
                    v = v * 0.5                   # a value-scaled block: its own row stride
                close(ops_triton.attention(q, k, v, kp, vp, lens, tables, rows, cfg, splits),
                      ops_torch.attention(q, k, v, kp, vp, lens, tables, rows, cfg),
                      f"attention causal={causal} rows={rows} splits={splits}", dtype)


SHAPES = ((6, 1000, 16, 1.0), (70, 8192 * 2 + 5, 24, 0.37))       # rows, vocabulary, rank, scale


def markov(device: str, dtype: torch.dtype, gen: torch.Generator, shapes=SHAPES) -> None:
    """DSpark's fused Markov step (bias GEMM + sum + pick) against the PyTorch one: the same pick
    wherever a float64 reference's winner is clear under the precision rule, greedy and sampled,
    over one and two row blocks, a rank that is and one that is not a power of two, a scale, a mapped
    vocabulary; and each stored value rounded to the dtype as PyTorch stores it."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    clear = total = hot_batches = 0
    for rows, cols, rank, scale in shapes:
        base, e, w = rnd(rows, 3, cols) * 2, rnd(rows, rank), rnd(cols, rank) / rank ** 0.5
        planted = torch.randint(0, cols, (rows,), generator=gen)
        at = (torch.arange(rows, device=device), 1, planted.to(device))
        base[at] = base[:, 1].amax(-1) + 12.0                                # a clear greedy winner
        temps = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0, 1.0, 0.5] * 10, device=device)[:rows]
        seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen).to(device)
        lens = torch.randint(0, 100_000, (rows,), generator=gen, dtype=torch.int32).to(device)
        ref = base[:, 1].double() + (e.double() @ w.double().T) * scale
        tol = logit_tolerance(dtype, ref)
        for step, keys in ((0, None), (2, torch.arange(cols, device=device) * 3 + 1)):
            for sampling in ((), (temps, seeds, lens, step, keys)):
                got = ops_triton.markov_pick(base[:, 1], e, w, scale, *sampling)
                want = ops_torch.markov_pick(base[:, 1], e, w, scale, *sampling)
                noised, t_tol = ref, tol
                if sampling:
                    hot = temps[:, None].double() != 0
                    t = torch.where(hot, temps[:, None].double(), 1.0)
                    kk = torch.arange(cols, device=device) if keys is None else keys
                    g = gumbel.noise(gumbel.step_seeds(seeds, step), lens.long() + step + gumbel.SALT, kk).double()
                    noised = torch.where(hot, ref / t + g, ref)
                    t_tol = tol / t + 1e-5 * noised.abs().amax(-1, keepdim=True)
                sure = clear_positions(noised, t_tol)
                assert torch.equal(got[sure], want[sure]), f"markov_pick rows={rows} rank={rank} {bool(sampling)}"
                if not sampling:
                    assert torch.equal(got.cpu(), planted), "markov_pick: the planted winner"
                clear, total = clear + int(sure.sum()), total + rows
        # in a sampled batch a request at temperature 0 drafts exactly its greedy draft (no planted
        # winner here: noise added to a cold row would move its pick)
        plain, cold = rnd(rows, cols) * 2, temps == 0
        for ops in (ops_torch, ops_triton):
            greedy = ops.markov_pick(plain, e, w, scale)
            sampled = ops.markov_pick(plain, e, w, scale, temps, seeds, lens, 1)
            assert torch.equal(sampled[cold], greedy[cold]), f"{ops.__name__}: a cold row was sampled"
            if (~cold).any():                 # a batch of one request runs only the cold temperature
                assert (sampled[~cold] != greedy[~cold]).any(), f"{ops.__name__}: no hot row was sampled"
                hot_batches += 1
    assert clear >= total * 3 // 4, (clear, total)                        # not vacuous
    assert hot_batches > 0, "no shape had a request at a temperature above 0"
    # each stored value rounded as PyTorch stores it: 1 + 2**-9 is 1 in bfloat16, a tie the first
    # index wins; 1 + 2**-6 wins, 1 + 2**-6 x 0.25 rounds to 1
    base = torch.full((1, 3, 40), -4.0, dtype=dtype, device=device)
    base[0, 2, 5] = base[0, 2, 30] = 1.0
    e = torch.zeros(1, 16, dtype=dtype, device=device)
    e[0, 0] = 1.0
    w = torch.zeros(40, 16, dtype=dtype, device=device)
    exact = dtype == torch.bfloat16
    for bias, scale, winner in ((2.0 ** -9, 1.0, 5 if exact else 30), (2.0 ** -6, 1.0, 30),
                                (2.0 ** -6, 0.25, 5 if exact else 30)):
        w[30, 0] = bias
        for ops in (ops_torch, ops_triton):
            assert int(ops.markov_pick(base[:, 2], e, w, scale)) == winner, (ops.__name__, bias, scale)
    # equal maxima in different column blocks (each block's maximum is found apart, then the
    # first of them is picked), greedy and sampled at temperature 0: the first column wins, as
    # torch.argmax picks
    block = triton_sampling.TILE[0]
    cols = 9 * block + 7
    wide = torch.full((2, cols), -4.0, dtype=dtype, device=device)
    w = torch.zeros(cols, 16, dtype=dtype, device=device)
    e = torch.zeros(2, 16, dtype=dtype, device=device)
    cold = (torch.zeros(2, device=device), torch.tensor([3, 4], device=device),
            torch.zeros(2, dtype=torch.int32, device=device), 0)
    for planted in ((5, block + 3), (block + 3, 3 * block), (2 * block + 1, cols - 1), (cols - 1,)):
        wide.fill_(-4.0)
        wide[:, list(planted)] = 1.0
        for ops in (ops_torch, ops_triton):
            for sampling in ((), cold):
                got = ops.markov_pick(wide, e, w, 1.0, *sampling).tolist()
                assert got == [planted[0]] * 2, (ops.__name__, planted, got, bool(sampling))
    # -0.0 ties +0.0 (a negative scale turns the zero bias into -0.0): the first column wins
    wide.fill_(-4.0)
    wide[:, 3], wide[:, 2 * block + 5] = -0.0, 0.0
    for ops in (ops_torch, ops_triton):
        assert ops.markov_pick(wide, e, w, -1.0).tolist() == [3, 3], ops.__name__


def markov_chain(device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    """DSpark's Markov head over several steps (``markov_drafts``: each step's previous token read from
    the step before, mapped to a target id) against a plain loop, in exact arithmetic: ``w1[t]`` is
    one-hot at ``t % r`` and ``w2[v]`` one-hot at ``(5 v + 3) % r``, so step ``i + 1`` adds the
    scale to the columns of one class, the class of step ``i``'s target id; the base logits are
    distinct within a row. A wrong previous token, mapping or column block changes the drafts.
    Greedy on any device; sampled (equal noise) under the interpreter."""
    block = triton_sampling.TILE[0]
    for rows, cols, rank, scale, mapped in ((6, 9 * block + 7, 16, 1.0, True), (70, 4 * block, 8, 0.5, False),
                                            (5, 2 * block + 3, 300, 1.0, True)):   # past one dot's rank
        k, extra = 5, 40
        perm = torch.randperm(cols, generator=gen)
        base = torch.stack([(perm.roll(3 * r + 7 * i) / cols * 0.5) for r in range(rows) for i in range(k)])
        base = base.view(rows, k, cols).to(device=device, dtype=dtype)
        d2t = torch.randint(0, extra, (cols,), generator=gen) if mapped else None
        vt = cols + (extra if mapped else 0)
        w1 = torch.nn.functional.one_hot(torch.arange(vt) % rank, rank).to(device=device, dtype=dtype)
        w2 = torch.nn.functional.one_hot((torch.arange(cols) * 5 + 3) % rank, rank).to(device=device, dtype=dtype)
        anchors = torch.randint(0, vt, (rows,), generator=gen)
        want, prev = [], anchors.clone()                       # the plain loop, on the CPU
        for i in range(k):
            cls = (torch.arange(cols) * 5 + 3) % rank == (prev % rank)[:, None]
            logits = base[:, i].cpu() + (cls * scale).to(dtype)
            prev = logits.argmax(-1)
            prev = prev if d2t is None else prev + d2t[prev]
            want.append(prev)
        want = torch.stack(want, 1)
        m = None if d2t is None else d2t.to(device)
        for ops in (ops_torch, ops_triton):
            got = ops.markov_drafts(base, anchors.to(device), w1, w2, scale, m)
            assert torch.equal(got.cpu(), want), (ops.__name__, rows, cols)
        assert (want[:, 1:] != want[:, :1]).any(), "the chain moves"
        temps = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0, 1.0, 0.5] * 10, device=device)[:rows]
        seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen).to(device)
        lens = torch.randint(0, 100_000, (rows,), generator=gen, dtype=torch.int32).to(device)
        keys = torch.arange(cols, device=device) * 3 + 1
        sampled = [ops.markov_drafts(base, anchors.to(device), w1, w2, scale, m, temps, seeds, lens, keys).cpu()
                   for ops in (ops_torch, ops_triton)]
        cold = (temps == 0).cpu()
        assert torch.equal(sampled[1][cold], want[cold]), "a cold row of a sampled batch drafts greedily"
        assert (sampled[1][~cold] != want[~cold]).any(), "no hot row was sampled"
        if device == "cpu":
            assert torch.equal(sampled[1], sampled[0]), "markov_drafts sampled"


def engines(device: str, dtype: str, gen: torch.Generator) -> None:
    from k3_accel.server.engines.base import IngestBatch, ProposeBatch
    from k3_accel.server.engines.dflash import DFlashEngine
    from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
    root = Path(tempfile.mkdtemp())
    target = write_tiny_target(root / "target")
    draft = write_tiny_dflash(root / "draft", target)
    pair = {kind: DFlashEngine(str(draft), str(target), device=device, dtype=dtype, kernels=kind,
                               budget_bytes=1 << 20, cuda_graphs=False) for kind in ("torch", "triton")}
    lens = [5, 16, 37]
    hidden = torch.randn(sum(lens), 256, generator=gen).to(torch.bfloat16)
    positions = torch.cat([torch.arange(n) for n in lens])
    out = {}
    for kind, engine in pair.items():
        states = [engine.new_state() for _ in lens]
        engine.ingest(IngestBatch(states, [0] * 3, lens, positions, torch.zeros(len(positions),
                                                                                dtype=torch.long),
                                  hidden))
        engine.ingest(IngestBatch([states[2]], [20], [3], torch.arange(20, 23),
                                  torch.zeros(3, dtype=torch.long), hidden[:3]))
        out[kind] = engine.propose(ProposeBatch(states, [[]] * 3, torch.tensor([1, 2, 3]), 7,
                                                logits="full"))
    close(out["triton"].logits, out["torch"].logits, "engine logits", getattr(torch, dtype))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    dtypes = ["float32"] if args.device == "cpu" else ["float32", "bfloat16"]
    for name in dtypes:
        kernels(args.device, getattr(torch, name), gen)
        engines(args.device, name, gen)
        print(f"{name}: ok", flush=True)
    print("all kernels agree")
