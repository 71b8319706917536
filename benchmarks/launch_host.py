"""What the V2 launch costs vLLM's step thread: host time of one ``v2_launch.launch`` call.

Every step of a V2 target (off steps included) launches its context: the meta columns and the
compacted rows on the device, then the copy to a pinned slot (:mod:`k3_accel.vllm.spec_decode.v2_launch`).
The P6 runs measured the plugin's whole ``propose`` at 1.06 ms of host time per step at B = 1
(``v2.propose``). Here the launch alone, side by side, alternating, median over ``--iters``: the scatter
as about 30 torch operations (``scatter_torch``, the CPU path) against the two Triton kernels
(``launch_triton.scatter``, the CUDA path), for decode steps (one row per request, Qwen3-8B-like aux
rows: 5 x 4096 bf16) at B = 1, 8, 32. Host wall time of the call only; the step's copies are then
waited for and its slot released outside the timing.

``summary.ratio`` = kernels / torch host time at B = 1 (CUDA only; on CPU the table has the torch path).

``held_<impl>_ms``: the same step held instead (:mod:`k3_accel.vllm.spec_decode.v2_held`, what an off
step costs the step thread while the adaptive controller keeps speculation off: the meta kernel, one
``torch.cat`` of the aux rows, the copies into a pinned region); ``summary.held_over_launch`` = held /
launch at B = 1 with the launch the machine uses (kernels on CUDA, torch ops on CPU). A region is
released outside the timing when full.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from report import emit  # noqa: E402

from k3_accel.vllm.spec_decode import v2_held, v2_launch  # noqa: E402

MAX_REQS, CAPACITY, AUX, HIDDEN = 64, 512, 5, 4096


def decode_batch(device: torch.device, b: int, pos: int):
    """An InputBatch stand-in for a decode step of ``b`` requests (one row each)."""
    qsl = np.arange(b + 1, dtype=np.int32)
    ids = [f"r{i}" for i in range(b)]
    ones = np.ones(b, dtype=np.int32)
    return types.SimpleNamespace(
        req_ids=ids, num_reqs=b, idx_mapping=torch.arange(b, dtype=torch.int64, device=device),
        idx_mapping_np=np.arange(b), query_start_loc=torch.from_numpy(qsl).to(device), query_start_loc_np=qsl,
        input_ids=torch.randint(0, 50000, (b,), dtype=torch.int32, device=device),
        positions=torch.full((b,), pos, dtype=torch.int64, device=device),
        num_computed_prefill_tokens_np=ones * pos, prefill_len_np=ones, num_scheduled_tokens=ones,
        num_draft_tokens=0)


def decode_step(device: torch.device, b: int) -> tuple:
    """Everything a decode step of ``b`` requests hands the launch: the batch, the aux rows,
    num_sampled, num_rejected, the last sampled and next prefill tokens by slot, the kept indices."""
    return (decode_batch(device, b, 600),
            [torch.randn(b, HIDDEN, device=device).to(torch.bfloat16) for _ in range(AUX)],
            torch.ones(b, dtype=torch.int32, device=device), torch.zeros(b, dtype=torch.int32, device=device),
            torch.randint(0, 50000, (MAX_REQS,), dtype=torch.int64, device=device),
            torch.zeros(MAX_REQS, dtype=torch.int32, device=device), np.arange(b))


def time_launch(rows, slots, device, b: int, iters: int) -> float:
    batch, aux, ns, nr, last, nxt, keep = decode_step(device, b)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step = v2_launch.launch(rows, slots, batch, aux, ns, nr, last, nxt, keep, 0, {}, None, 5.0)
        times.append(time.perf_counter() - t0)
        step.wait_ready()
        step.release()
    return statistics.median(times) * 1e3


def time_held(rows, device, b: int, iters: int) -> float:
    batch, aux, ns, nr, last, nxt, keep = decode_step(device, b)
    hold = v2_held.HeldSteps.sized(CAPACITY, AUX * HIDDEN, torch.bfloat16, MAX_REQS, pin=device.type == "cuda")
    times = []
    for _ in range(iters):
        if not hold.fits(b):
            region = hold.take(batch.req_ids)
            region.wait_ready()
            region.release()
        t0 = time.perf_counter()
        hold.add(rows, batch, aux, ns, nr, last, nxt, keep)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    impls = {"torch": v2_launch.scatter_torch}
    if cuda:
        from k3_accel.vllm.spec_decode import launch_triton
        impls["kernels"] = launch_triton.scatter
    table = []
    for b in (1, 8, 32):
        row = {"B": b}
        runs: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(3):                               # alternating rounds
            for name, fn in impls.items():
                rows = v2_launch.DeviceRows(CAPACITY, AUX * HIDDEN, torch.bfloat16, MAX_REQS, device)
                rows.scatter = fn
                slots = v2_launch.LaunchSlots(2, CAPACITY, AUX * HIDDEN, torch.bfloat16, MAX_REQS, pin=cuda)
                time_launch(rows, slots, device, b, 20)  # warm-up (Triton compiles, pinned caches)
                runs[name].append(time_launch(rows, slots, device, b, args.iters))
                time_held(rows, device, b, 20)
                runs.setdefault(f"held_{name}", []).append(time_held(rows, device, b, args.iters))
        for name, vals in runs.items():
            row[f"{name}_ms"] = statistics.median(vals)
        if "kernels" in runs:
            row["ratio"] = row["kernels_ms"] / row["torch_ms"]
        used = "kernels" if "kernels" in impls else "torch"
        row["held_over_launch"] = row[f"held_{used}_ms"] / row[f"{used}_ms"]
        table.append(row)
        print(row, flush=True)
    machine = (torch.cuda.get_device_name(device) if cuda else f"{platform.machine()}, CPU") + \
        f", torch {torch.__version__}"
    doc = {"benchmark": "launch_host", "config": {"max_reqs": MAX_REQS, "capacity": CAPACITY, "aux": AUX,
                                                   "hidden": HIDDEN, "iters": args.iters},
           "table": table,
           "summary": {"metric": "host time of one V2 launch (decode step, B = 1): Triton kernels / torch ops",
                       "ratio": table[0].get("ratio"), "goal": 0.5, "machine": machine,
                       "held_over_launch": table[0]["held_over_launch"],
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
