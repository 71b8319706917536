"""What the engine guarantees in reduced precision, and the Triton kernels' logic.

* bfloat16 (CPU here, CUDA in test_dflash_gpu.py): logits within the bf16
  tolerance of the float64 reference and drafts equal wherever the
  reference's margin is clear (``k3_accel.testing.precision``); no assertion
  depends on how one machine rounds or breaks ties.
* The Triton kernels run under Triton's interpreter (float32, CPU) in a
  subprocess and must agree with the PyTorch ops, kernel by kernel and as a
  whole engine.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_support import Mirror, checkpoint, random_rows, reference
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("dflash"))


def test_bfloat16_within_precision_rule(ckpt):
    engine = DFlashEngine(str(ckpt[0]), str(ckpt[1]), dtype="bfloat16", budget_bytes=1 << 20)
    assert engine.dtype == torch.bfloat16 and engine.cache.kv.dtype == torch.bfloat16
    ref = DFlashReference(*ckpt)
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(11)
    reqs = [m.new() for _ in range(4)]
    m.ingest([(r, 0, random_rows(gen, n)) for r, n in zip(reqs, (3, 17, 33, 50))])
    m.ingest([(reqs[1], 10, random_rows(gen, 12)), (reqs[3], 50, random_rows(gen, 5))])
    clear = total = 0
    for k, anchors in ((7, [5, 50, 150, 250]), (3, [6, 60, 160, 260])):
        prop = m.propose(reqs, anchors, k)
        for i, (r, a) in enumerate(zip(reqs, anchors)):
            want = reference(ref, m.rows[r], a, k)
            check_logits(prop.logits[i], want, torch.bfloat16)
            clear += check_drafts(prop.tokens[i], want, torch.bfloat16)
            total += k
    assert clear >= total // 4, (clear, total)       # the draft check is not vacuous


def test_triton_kernels_interpreted():
    """Every Triton kernel and the whole engine with ``kernels="triton"`` under
    TRITON_INTERPRET=1 (float32 on the CPU) against the PyTorch path."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    res = subprocess.run([sys.executable, str(HERE / "dflash_triton_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "all kernels agree" in res.stdout
