"""The scheduler gate's shared word (:mod:`k3_accel.vllm.spec_decode.gate`), across real processes.

What the scheduler (the engine core process) reads is what the driver rank's draft thread (the
same or another process) wrote last; no gate, or a closed one, is vLLM's own K.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types

from helpers.server import SRC
from k3_accel.vllm.spec_decode.gate import Gate, engine_key, gate_path, gated


def _read_in_child(path: str, k: int) -> int:
    code = ("import sys; from k3_accel.vllm.spec_decode.gate import Gate, gated; "
            f"print(gated({k}, Gate({path!r}, writer=False)))")
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_another_process_reads_what_the_writer_wrote_last(tmp_path):
    path = str(tmp_path / "gate")
    assert _read_in_child(path, 7) == 7                   # nothing written yet: vLLM's own K
    writer = Gate(path, writer=True, k=7)
    reader = Gate(path, writer=False)
    try:
        assert _read_in_child(path, 7) == 7 and gated(7, reader) == 7
        writer.set(0)
        assert _read_in_child(path, 7) == 0 and gated(7, reader) == 0
        writer.set(3)
        assert _read_in_child(path, 7) == 3 and gated(7, reader) == 3
        assert gated(2, reader) == 2                      # never above what vLLM schedules
    finally:
        writer.close()
    assert not os.path.exists(path)
    assert gated(7, reader) == 7                          # a reader that had it mapped: vLLM's K again
    assert gated(7, None) == 7


def test_a_short_or_foreign_file_is_no_gate(tmp_path):
    path = tmp_path / "gate"
    path.write_bytes(b"\x00")
    assert gated(5, Gate(str(path), writer=False)) == 5


def test_a_driver_worker_in_a_child_process_gates_its_parents_scheduler():
    """With several GPUs (executor ``mp``) the draft thread runs in a worker process the engine
    core started; its gate is the one the engine core's scheduler reads."""
    code = ("import types; from k3_accel.vllm.spec_decode.gate import Gate, engine_key, gate_path; "
            "cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(distributed_executor_backend='mp')); "
            "g = Gate(gate_path(engine_key(cfg, writer=True)), writer=True, k=0); print(g.path)")
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(distributed_executor_backend="mp"))
    path = gate_path(engine_key(cfg, writer=False))
    try:
        assert out.stdout.strip() == path
        assert gated(7, Gate(path, writer=False)) == 0
    finally:
        os.unlink(path)
    one = types.SimpleNamespace(parallel_config=types.SimpleNamespace(distributed_executor_backend="uni"))
    assert engine_key(one, writer=True) == engine_key(one, writer=False)    # one GPU: the same process


def test_gate_paths_are_per_engine_and_safe():
    a, b = gate_path("1234"), gate_path("5678")
    assert a != b and os.path.dirname(a) == os.path.dirname(b)
    assert "/" not in os.path.basename(gate_path("../../etc/x"))
