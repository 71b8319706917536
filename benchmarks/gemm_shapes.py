"""The draft step's matrix products at the Qwen3-8B-like DSpark shape, each timed several ways.

For each product of one propose (q/k/v, o, gate/up, down, lm_head; ``M`` = B x K query rows for
B in ``--batches``, K = 7) on the device: ``linear`` (``F.linear(x, W)``, what the engine runs),
``mm_t`` (``x @ Wt`` with the weight stored transposed: cuBLAS sees the other layout and picks
its own kernel), ``pad64`` (``F.linear`` over M rounded up to 64 rows) and, where torch offers
the switch, ``linear_cublas`` / ``linear_cublaslt`` (``torch.backends.cuda.preferred_blas_library``).
Device microseconds per call, ``reps`` calls captured in one CUDA graph (no host launch time),
and TFLOP/s. Diagnosis, not a goal: prints one JSON document (``--out`` too); ``summary.ratio``:
the fastest way's time over F.linear's, summed over the products at the largest M.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_step_parts import graph_ms  # noqa: E402
from report import emit  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}     # (N out features, K in features)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_shapes.py needs a CUDA device")
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    switch = getattr(torch.backends.cuda, "preferred_blas_library", None)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k ** -0.5
        wt = w.t().contiguous()
        for b in (int(x) for x in args.batches.split(",")):
            m = b * args.k
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            xp = torch.zeros(-(-m // 64) * 64, k, device=dev, dtype=dtype)
            xp[:m] = x
            ways = {"linear": lambda: F.linear(x, w), "mm_t": lambda: x @ wt, "pad64": lambda: F.linear(xp, w)}
            row = {"gemm": name, "M": m, "N": n, "K": k}
            for way, fn in ways.items():
                row[f"{way}_us"] = 1e3 * graph_ms(fn, args.iters)
            if switch is not None:
                before = switch()
                for lib in ("cublas", "cublaslt"):
                    try:
                        switch(lib)
                        row[f"linear_{lib}_us"] = 1e3 * graph_ms(lambda: F.linear(x, w), args.iters)
                    except Exception as exc:        # noqa: BLE001 - a library this build lacks
                        row[f"linear_{lib}_us"] = repr(exc)[:60]
                switch(before)
            flop = 2 * m * n * k
            row["linear_tflops"] = flop / row["linear_us"] / 1e6
            row["best"] = min((v, key) for key, v in row.items() if key.endswith("_us") and isinstance(v, float))[1]
            rows.append(row)
            print(json.dumps(row), flush=True)
    largest = [r for r in rows if r["M"] == max(x["M"] for x in rows)]
    best = sum(min(v for k, v in r.items() if k.endswith("_us") and isinstance(v, float)) for r in largest)
    emit({"benchmark": "gemm_shapes", "torch": torch.__version__, "table": rows, "summary": {
        "metric": f"sum over the products at M={largest[0]['M']}: the fastest way / F.linear (the engine's)",
        "ratio": best / sum(r["linear_us"] for r in largest), "goal": "diagnosis (issue 22: the B = 32 step)",
        "machine": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat()}}, args.out)


if __name__ == "__main__":
    main()
