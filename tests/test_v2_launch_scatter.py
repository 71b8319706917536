"""The V2 launch's scatter (meta columns, compacted rows) in two Triton kernels, as the torch
operations do it: random steps with rejected rows, requests left out, blocks with no valid row and
rows past a trimmed device end (``launch_triton_check.py``; exact, integers and copied rows)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def test_the_launch_kernels_scatter_as_the_torch_operations_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    res = subprocess.run([sys.executable, str(HERE / "launch_triton_check.py"), "--steps", "120"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "the scatters agree" in res.stdout


@pytest.mark.gpu
def test_the_compiled_launch_kernels_scatter_as_the_torch_operations():
    import launch_triton_check
    launch_triton_check.check("cuda", 300, 1)


def test_kernels_that_do_not_compile_leave_the_torch_launch_and_say_so(monkeypatch, caplog):
    """Where the launch kernels cannot be built (a Triton that does not compile them), the buffers
    keep the torch scatter, with one warning, instead of failing the speculator."""
    from k3_accel.vllm.spec_decode import launch_triton, v2_launch

    def broken(rows):
        raise RuntimeError("no compiler here")

    def kernels(*args):
        raise AssertionError("never called: the warm-up failed")

    monkeypatch.setattr(v2_launch, "_scatter_for", lambda device: kernels)
    monkeypatch.setattr(launch_triton, "warm", broken)
    with caplog.at_level("WARNING", logger="k3_accel.vllm"):
        rows = v2_launch.DeviceRows(16, 0, torch.bfloat16, 4, torch.device("cpu"))
    assert rows.scatter is v2_launch.scatter_torch
    assert any("did not compile" in r.getMessage() and "no compiler here" in r.getMessage() for r in caplog.records)


def test_kernels_that_compile_are_the_ones_the_launch_uses(monkeypatch):
    """The build-time compile sees finished buffers (their device, their meta) and, when it succeeds,
    the launch runs the kernels: a warm-up that fails for a half-built object must not quietly
    leave every step on the slower torch operations."""
    from k3_accel.vllm.spec_decode import launch_triton, v2_launch
    warmed = []

    def kernels(*args):
        raise AssertionError("not called while building")

    def warm(rows):
        warmed.append((rows.device, rows.cuda, tuple(rows.meta.shape), tuple(rows.dst.shape)))

    monkeypatch.setattr(v2_launch, "_scatter_for", lambda device: kernels)
    monkeypatch.setattr(launch_triton, "warm", warm)
    rows = v2_launch.DeviceRows(16, 0, torch.bfloat16, 4, torch.device("cpu"))
    assert warmed == [(torch.device("cpu"), False, (v2_launch.META_ROWS, 4), (16,))]
    assert rows.scatter is kernels
