"""Pieces of ``draft_step.py``: device ceilings, ingest points, the attention
kernel comparison and a profile of one eager step."""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from k3_accel.server.engines.base import IngestBatch, ProposeBatch
from k3_accel.server.engines.dflash import ops_torch
from k3_accel.server.engines.dflash.config import DFlashConfig


def _events_ms(fn, iters: int) -> float:
    """Median device milliseconds of ``fn`` (CUDA events), after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bandwidths(device: str, quick: bool) -> dict:
    """Copy bandwidth (read + write bytes / s), host-to-device (pinned, pageable) and the
    bf16 matrix rate, measured now."""
    if not device.startswith("cuda"):
        return {"copy": 20e9, "h2d_pinned": 20e9, "h2d_pageable": 10e9, "matmul_flops": 1e11,
                "note": "CPU: nominal figures, not measured"}
    n = (256 << 20) if quick else (2 << 30)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8,
                                                                           device=device)
    src.random_(0, 255)
    copy = 2 * n / (_events_ms(lambda: dst.copy_(src), 10) / 1e3)
    del src, dst
    h = 256 << 20
    pinned = torch.empty(h, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    pageable = torch.empty(h, dtype=torch.uint8).random_(0, 255)
    dev = torch.empty(h, dtype=torch.uint8, device=device)
    h2d_pinned = h / (_events_ms(lambda: dev.copy_(pinned, non_blocking=True), 5) / 1e3)
    h2d_pageable = h / (_events_ms(lambda: dev.copy_(pageable), 5) / 1e3)
    m = 4096 if quick else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    flops = 2 * m ** 3 / (_events_ms(lambda: a @ b, 10) / 1e3)
    return {"copy": copy, "h2d_pinned": h2d_pinned, "h2d_pageable": h2d_pageable,
            "matmul_flops": flops}


def propose_flops(cfg: DFlashConfig, b: int, k: int, ctx: int) -> float:
    """Matrix FLOPs of one propose (layers over B(k+1) rows, lm_head over Bk, attention)."""
    rows, h = b * (k + 1), cfg.hidden_size
    per_row = 2 * h * (cfg.q_size + 2 * cfg.kv_size) + 2 * cfg.q_size * h + 6 * h * cfg.intermediate_size
    attn = 4 * rows * cfg.num_heads * cfg.head_dim * (ctx + k + 1)
    return cfg.num_layers * (rows * per_row + attn) + 2 * b * k * h * cfg.vocab_size


def ingest_points(engine, weights, cfg: DFlashConfig, rows: int, bw: dict, sync) -> list[dict]:
    """One ``rows``-row chunk from host memory into a fresh request, pageable and pinned."""
    out = []
    elem = torch.empty((), dtype=weights.dtype).element_size()
    host = torch.randn(rows, cfg.context_width).to(torch.bfloat16)
    device_bytes = (weights.fc.numel() + 2 * cfg.num_layers * cfg.kv_size * cfg.hidden_size) * elem \
        + host.numel() * host.element_size() + rows * engine.bytes_per_row
    sources = [("pageable", host)]
    if engine.device.type == "cuda":
        sources.append(("pinned", host.pin_memory()))
    for kind, src in sources:
        state = engine.new_state()

        def once():
            engine.ingest(IngestBatch([state], [0], [rows], torch.arange(rows),
                                      torch.zeros(rows, dtype=torch.long), src))
        seconds = []
        for i in range(6):
            t0 = time.perf_counter()
            once()
            sync()
            if i:
                seconds.append(time.perf_counter() - t0)
        floor = max(src.numel() * src.element_size() / bw["h2d_pinned"], device_bytes / bw["copy"])
        ms = 1e3 * statistics.median(seconds)
        out.append({"rows": rows, "source": kind, "ingest_ms": ms, "floor_ms": 1e3 * floor,
                    "ratio": ms / (1e3 * floor)})
        engine.release(state)
        print(out[-1], flush=True)
    return out


def sweep(engine, q, k, v, kp, vp, batch, rows, splits, iters) -> list[dict]:
    """Kernel tile sizes, warps, pipeline stages and context splits, each timed."""
    out = []
    configs = [dict(block_n=n, num_warps=w, num_stages=st) for n in (32, 64, 128) for w in (4, 8)
               for st in (2, 3)]
    for tune in configs:
        try:
            ms = _events_ms(lambda: engine.ops.attention(q, k, v, kp, vp, batch.ctx_lens, batch.tables,
                                                         rows, engine.config, splits, tune), iters)
        except Exception as exc:                      # e.g. out of shared memory
            ms = repr(exc)[:80]
        out.append({**tune, "splits": splits, "ms": ms})
    for n_split in sorted({1, 2, 4, 8, 16, 33, 64} - {splits}):
        ms = _events_ms(lambda: engine.ops.attention(q, k, v, kp, vp, batch.ctx_lens, batch.tables, rows,
                                                     engine.config, n_split), iters)
        out.append({"splits": n_split, "ms": ms})
    return out


def graph_ms(fn, iters: int, reps: int = 20) -> float:
    """Median device milliseconds of one ``fn`` call, ``reps`` calls captured in one CUDA graph
    and replayed (so the host's launch time between calls is not counted, as in the engine)."""
    fn(), fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return _events_ms(graph.replay, iters) / reps


def splits_sweep(engine, states, rows: int, iters: int, copy_bw: float) -> dict:
    """One layer's Triton attention for ``len(states)`` requests of ``rows`` query rows at each
    context split count (the engine's rule's choice first): device ms per call in a graph
    (:func:`graph_ms`), against reading the requests' K/V once (``kv_read_once_ms``)."""
    cfg, b = engine.config, len(states)
    width = max(len(s.blocks) for s in states)
    buf = engine.host_inputs(torch.zeros(b, dtype=torch.long), states, b, width).to(engine.device)
    batch = engine.device_batch(buf, b, width, rows)          # only its lengths and tables are read
    gen = torch.Generator(device=engine.device).manual_seed(0)
    qkv = torch.randn(b * rows, cfg.q_size + 2 * cfg.kv_size, device=engine.device, dtype=engine.dtype,
                      generator=gen)
    q, k, v = qkv[:, :cfg.q_size], qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size], qkv[:, cfg.q_size + cfg.kv_size:]
    kp, vp = engine.cache.kv[0, 0], engine.cache.kv[1, 0]
    tokens = int(batch.ctx_lens.sum())
    out = {"rule": engine._splits(b), "kv_read_once_ms": 1e3 * tokens * 2 * cfg.kv_size * kp.element_size() / copy_bw}
    for n in dict.fromkeys([engine._splits(b), 1, 2, 4, 8, 16]):
        out[f"splits_{n}_ms"] = graph_ms(lambda: engine.ops.attention(
            q, k, v, kp, vp, batch.ctx_lens, batch.tables, rows, cfg, n), iters)
    for n, w, st in ((64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3), (32, 4, 4)):   # the rule's splits
        tune = dict(block_n=n, num_warps=w, num_stages=st)
        try:
            out[f"tile_{n}_{w}_{st}_ms"] = graph_ms(lambda: engine.ops.attention(
                q, k, v, kp, vp, batch.ctx_lens, batch.tables, rows, cfg, engine._splits(b), tune), iters)
        except Exception as exc:                      # e.g. out of shared memory
            out[f"tile_{n}_{w}_{st}_ms"] = repr(exc)[:80]
    return out


def attention_choice(engine, ctx_states: dict, contexts, sync, iters: int, copy_bw: float
                     ) -> list[dict]:
    """One layer's attention at K=7 (B=32; and B=1, 8 at the longest context): the
    engine's kernel (and a sweep of its tuning), the PyTorch gather path,
    and SDPA over padded dense K/V (gather excluded and included), against reading
    that K/V once."""
    if engine.device.type != "cuda":
        return []
    cfg, out = engine.config, []
    rows = 8
    gen = torch.Generator(device=engine.device).manual_seed(0)
    points = [(32, c) for c in contexts] + [(b, contexts[-1]) for b in (1, 8)]
    for b, c in points:
        states = ctx_states[c][:b]
        width = max(len(s.blocks) for s in states)
        buf = engine.host_inputs(torch.zeros(b, dtype=torch.long), states, b, width).to(engine.device)
        batch = engine.device_batch(buf, b, width, rows - 1)
        qkv = torch.randn(b * rows, cfg.q_size + 2 * cfg.kv_size, device=engine.device,
                          dtype=engine.dtype, generator=gen)
        q, k, v = qkv[:, :cfg.q_size], qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size], \
            qkv[:, cfg.q_size + cfg.kv_size:]
        kp, vp = engine.cache.kv[0, 0], engine.cache.kv[1, 0]
        floor_ms = 1e3 * b * c * 2 * cfg.kv_size * engine.cache.kv.element_size() / copy_bw
        point = {"B": b, "K": rows - 1, "context": c, "kv_read_once_ms": floor_ms}
        splits = engine._splits(b)
        if engine.ops is not ops_torch:
            point["triton_paged_ms"] = _events_ms(lambda: engine.ops.attention(
                q, k, v, kp, vp, batch.ctx_lens, batch.tables, rows, cfg, splits), iters)
            point["triton_sweep"] = sweep(engine, q, k, v, kp, vp, batch, rows, splits, iters)
        if c <= 1024:
            point["torch_gather_ms"] = _events_ms(lambda: ops_torch.attention(
                q, k, v, kp, vp, batch.ctx_lens, batch.tables, rows, cfg), max(3, iters // 4))
        j = torch.arange(width * kp.shape[1], device=engine.device)
        slots = batch.tables.long()[:, j // kp.shape[1]] * kp.shape[1] + j % kp.shape[1]

        def dense():
            keys = torch.cat([kp.reshape(-1, cfg.num_kv_heads, cfg.head_dim)[slots],
                              k.view(b, rows, cfg.num_kv_heads, cfg.head_dim)], 1).transpose(1, 2)
            vals = torch.cat([vp.reshape(-1, cfg.num_kv_heads, cfg.head_dim)[slots],
                              v.view(b, rows, cfg.num_kv_heads, cfg.head_dim)], 1).transpose(1, 2)
            return keys, vals
        keys, vals = dense()
        mask = torch.cat([j[None] < batch.ctx_lens[:, None],
                          torch.ones(b, rows, dtype=torch.bool, device=engine.device)], 1)
        mask = mask[:, None, None, :]
        qh = q.reshape(b, rows, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        point["sdpa_dense_ms"] = _events_ms(lambda: F.scaled_dot_product_attention(
            qh, keys, vals, attn_mask=mask, enable_gqa=True), iters)

        def gathered():
            kk, vv = dense()
            return F.scaled_dot_product_attention(qh, kk, vv, attn_mask=mask, enable_gqa=True)
        point["sdpa_with_gather_ms"] = _events_ms(gathered, iters)
        out.append(point)
        print(point, flush=True)
    sync()
    return out


def profile_step(engine, states, cfg: DFlashConfig, path: str | None) -> dict:
    """Device time per kernel family of one eager propose (K=7), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    b, k = len(states), 7
    batch = ProposeBatch(states, [[]] * b, torch.zeros(b, dtype=torch.long), k)
    graphs, engine.graphs = engine.graphs, None
    try:
        engine.propose(batch).wait()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.propose(batch).wait()
    finally:
        engine.graphs = graphs
    families: dict[str, float] = defaultdict(float)
    total = 0.0
    for ev in prof.key_averages():
        us = ev.self_device_time_total
        if not us or ev.key.startswith("cuda") or ev.key.startswith("Memcpy"):
            if ev.key.startswith("Memcpy"):
                families["memcpy"] += us
                total += us
            continue
        name = ev.key.lower()
        fam = ("attention" if "attention" in name or "combine" in name else
               "norm" if "norm" in name else
               "rope+qk_norm" if "rope" in name else
               "silu_mul" if "silu" in name else
               "gemm" if any(s in name for s in ("gemm", "gemv", "sm90", "cutlass", "xmma", "nvjet"))
               else "argmax/other")
        families[fam] += us
        total += us
    if path:
        with open(path, "a") as f:
            f.write(f"\n# one eager propose, B={b}, K={k}\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    return {"batch": b, "k": k, "context": max(s.length for s in states),
            "device_us_total": total, "device_us_by_family": dict(families)}
