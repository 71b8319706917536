"""Run by test_v2_launch_scatter.py in a subprocess: the V2 launch's two Triton kernels
(:mod:`k3_accel.vllm.spec_decode.launch_triton`) against the torch scatter, on random steps.

On the CPU it needs TRITON_INTERPRET=1; with ``--device cuda`` the compiled kernels run. Prints
"the scatters agree" at the end. Everything compared is an integer or a copied row: exact.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from k3_accel.vllm.spec_decode import launch_triton
from k3_accel.vllm.spec_decode.v2_launch import DeviceRows, scatter_torch

MAX_REQS, CAPACITY = 40, 512


def random_step(rng: np.random.Generator, device: str) -> dict:
    """A step as vLLM's V2 runner hands it over: ``r`` requests in slots of ``MAX_REQS``, each ran
    ``1 + verified`` rows (prefill chunks longer), some rows rejected, some requests not kept, the
    device's query_start_loc trimmed below the host's where adaptive verification cut drafts."""
    r = int(rng.integers(1, 13))
    ran_host = rng.integers(1, 10, size=r)
    ran_host[rng.random(r) < 0.2] = rng.integers(10, 30)          # prefill chunks
    trim = np.where(rng.random(r) < 0.3, rng.integers(0, ran_host), 0)
    ran = ran_host - trim                                          # what the device ran
    rejected = np.where(rng.random(r) < 0.7, rng.integers(0, ran), 0)
    if rng.random() < 0.2:
        i = int(rng.integers(r))
        rejected[i] = ran[i]                                       # a block with no valid row
    qsl = np.zeros(r + 1, dtype=np.int32)
    np.cumsum(ran, out=qsl[1:])
    n = int(ran_host.sum())                                        # the host's upper bound
    slots = rng.permutation(MAX_REQS)[:r].astype(np.int32)

    def dev(a, dtype):
        return torch.as_tensor(np.asarray(a)).to(dtype).to(device)

    return dict(r=r, n=n, qsl=dev(qsl, torch.int32), num_rejected=dev(rejected, torch.int32),
                kept=dev(rng.random(r) < 0.8, torch.int64), num_sampled=dev(rng.integers(0, 3, size=r), torch.int32),
                last=dev(rng.integers(0, 50000, size=MAX_REQS), torch.int64),
                nxt=dev(rng.integers(0, 50000, size=MAX_REQS), torch.int32), slot_idx=dev(slots, torch.int32),
                positions=dev(rng.integers(0, 4000, size=n), torch.int64),
                input_ids=dev(rng.integers(0, 50000, size=n), torch.int32))


def check(device: str, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dev = torch.device(device)
    rows = DeviceRows(CAPACITY, 0, torch.bfloat16, MAX_REQS, dev)
    launch_triton.warm(rows)                     # the build-time compile: one request, one row
    assert rows.meta[0, 0].item() == 1 and rows.token_ids[0].item() == 0 and rows.dst[0].item() == 0
    for step in range(steps):
        args = random_step(rng, device)
        outs = []
        for fn in (scatter_torch, launch_triton.scatter):
            rows = DeviceRows(CAPACITY, 0, torch.bfloat16, MAX_REQS, dev)
            rows.meta.fill_(-7)
            rows.token_ids.fill_(-7)
            dst = fn(rows, **args).clone()
            outs.append((rows.meta.cpu(), rows.token_ids.cpu(), dst.cpu()))
        (meta_t, tok_t, dst_t), (meta_k, tok_k, dst_k) = outs
        r = args["r"]
        where = f"step {step} (r={r}, n={args['n']})"
        for row in (0, 1, 2, 3, 6):
            assert torch.equal(meta_t[row, :r], meta_k[row, :r]), (where, row, meta_t[row, :r], meta_k[row, :r])
        assert torch.equal(dst_t, dst_k), (where, dst_t, dst_k)
        kept_rows = dst_t[dst_t < CAPACITY]
        assert torch.equal(tok_t[kept_rows], tok_k[kept_rows]), where
        total = int(meta_t[0, :r].sum())
        assert sorted(kept_rows.tolist()) == list(range(total)), where     # compacted, each slot once
        assert torch.equal(tok_k[total:CAPACITY], torch.full((CAPACITY - total,), -7)), where   # nothing else written
    print("the scatters agree")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    check(a.device, a.steps, a.seed)
