"""The V2 launch's scatter (meta columns, compacted rows) in two Triton kernels, as the torch
operations do it: random steps with rejected rows, requests left out, blocks with no valid row and
rows past a trimmed device end (``launch_triton_check.py``; exact, integers and copied rows)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
