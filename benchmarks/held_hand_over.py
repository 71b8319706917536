"""What handing a region of held off steps to the server costs the draft thread (V2, ``v2_held``).

While the adaptive controller keeps speculation off, the V2 step thread holds each off step's rows
in a pinned region (up to 32 steps). The region goes to the draft thread when a probe nears, and the
probe's drafts wait until its rows are on the server. P6 on an H200 (B = 32, Qwen3-8B's aux width,
2026-12-06) saw both probes of a run miss the 100 ms deadline after a full region was handed over at
the probe. A full region at B = 32 holds 1,024 rows, 42 MB.

This times the draft thread's part, side by side, alternating, median of ``--repeats``:

* ``merged_ms``: :meth:`~k3_accel.vllm.spec_decode.v2_held.HeldLaunch.merged`: the region as one
  ingest, gathered once out of the region into reused rows;
* ``per_step_ms``: the path before it (still the fallback): each step's rows copied out
  (:meth:`~.v2_held.HeldLaunch.step_inputs`), merged through :class:`~.off_rows.OffRows` (a
  concatenation and a reorder).

Both make the same ingest (checked). Decode steps of B requests (one row each, positions continuing)
with 5 x 4096 bf16 aux rows, ``HOLD_STEPS`` steps a region, B = 1, 8, 32. What follows on either path
is the same (the client's copy into its staging slot, the socket, the server's ingest) and is not
timed. ``summary.ratio`` = merged / per-step at B = 32.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from launch_host import AUX, HIDDEN, MAX_REQS, decode_batch, decode_step  # noqa: E402
from report import emit  # noqa: E402

from k3_accel.vllm.spec_decode import v2_held, v2_launch  # noqa: E402
from k3_accel.vllm.spec_decode.off_rows import MAX_BYTES, OffRows  # noqa: E402


def fill(hold, rows, device: torch.device, b: int):
    """One region of ``HOLD_STEPS`` decode steps (the same rows every call), taken for the draft thread
    once its copies are done."""
    torch.manual_seed(0)
    _, aux, ns, nr, last, nxt, keep = decode_step(device, b)
    for t in range(v2_held.HOLD_STEPS):
        hold.add(rows, decode_batch(device, b, 600 + t), aux, ns, nr, last, nxt, keep)
    region = hold.take([f"r{i}" for i in range(b)])
    region.wait_ready()
    return region


def merged(region):
    t0 = time.perf_counter()
    out = region.merged()
    return time.perf_counter() - t0, out


def per_step(region):
    t0 = time.perf_counter()
    off = OffRows(1 << 20, MAX_BYTES)
    for inp in region.step_inputs():
        off.add(inp, owned=True)
    out = off.take()
    return time.perf_counter() - t0, out


def same(a, b) -> bool:
    return (list(a.req_ids) == list(b.req_ids) and list(a.counts) == list(b.counts)
            and torch.equal(a.positions, b.positions) and torch.equal(a.token_ids, b.token_ids)
            and torch.equal(a.hidden, b.hidden) and [int(x) for x in a.anchor_positions] == [int(x) for x in b.anchor_positions])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    width = AUX * HIDDEN
    rows = v2_launch.DeviceRows(MAX_REQS, width, torch.bfloat16, MAX_REQS, device)
    if cuda:
        from k3_accel.vllm.spec_decode import launch_triton
        rows.scatter = launch_triton.scatter
    table = []
    for b in (1, 8, 32):
        hold = v2_held.HeldSteps.sized(8192, width, torch.bfloat16, MAX_REQS, pin=cuda)
        runs: dict[str, list[float]] = {"merged": [], "per_step": []}
        for rep in range(args.repeats + 1):                 # the first round warms up
            got = {}
            for name, fn in (("merged", merged), ("per_step", per_step)):
                region = fill(hold, rows, device, b)
                try:
                    seconds, got[name] = fn(region)
                finally:
                    region.release()
                if rep:
                    runs[name].append(seconds * 1e3)
            if not same(got["merged"], got["per_step"]):
                raise SystemExit(f"B={b}: the merged region differs from the per-step merge")
        row = {"B": b, "rows": b * v2_held.HOLD_STEPS, "mbytes": round(b * v2_held.HOLD_STEPS * width * 2 / 1e6, 1),
               **{f"{name}_ms": round(statistics.median(v), 3) for name, v in runs.items()}}
        row["ratio"] = round(row["merged_ms"] / row["per_step_ms"], 3)
        table.append(row)
        print(row, flush=True)
    machine = (torch.cuda.get_device_name(device) if cuda else f"{platform.machine()}, CPU ({platform.processor() or 'unknown'})") + \
        f", torch {torch.__version__}, {torch.get_num_threads()} threads"
    doc = {"benchmark": "held_hand_over", "config": {"aux": AUX, "hidden": HIDDEN, "steps": v2_held.HOLD_STEPS,
                                                     "repeats": args.repeats},
           "table": table,
           "summary": {"metric": "draft-thread time to hand a full region of held off steps over (B = 32, "
                                 "42 MB): one gather / per-step copies merged through OffRows",
                       "ratio": table[-1]["ratio"], "goal": None, "machine": machine,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
