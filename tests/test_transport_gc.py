"""A client dropped without close() must not hang its process (zmq's term() at GC)."""
from __future__ import annotations

import subprocess
import sys

from helpers.server import ServerProcess, src_env

SCRIPT = """
import gc, sys, torch
from k3_accel.transport.api import ClientSettings, StepInput
from k3_accel.transport.client import DraftClient
client = DraftClient(ClientSettings(address=sys.argv[1], ring_depth=2, max_rows=64)).start()
client.step(StepInput(["a"], [3], torch.arange(3), torch.tensor([1, 2, 1]), [False], [2], [3], k=0))
del client
gc.collect()
print("collected")
"""


def test_dropped_client_is_collected_without_hanging():
    server = ServerProcess("--engine", "ngram")
    try:
        run = subprocess.run([sys.executable, "-c", SCRIPT, server.address], capture_output=True, text=True,
                             env=src_env(), timeout=120)
        assert run.returncode == 0 and "collected" in run.stdout, run.stderr[-2000:]
    finally:
        assert server.stop() == 0
