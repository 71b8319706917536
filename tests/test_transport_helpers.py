"""Shared pieces for the transport tests: a real draft-server subprocess and a pausable relay.

Imported by the other ``test_transport_*`` modules; the two tests here check
the helpers themselves.
"""
from __future__ import annotations

import collections
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq

from k3_accel.transport.api import ClientSettings, StepInput
from k3_accel.transport.client import DraftClient

SRC = str(Path(__file__).resolve().parents[1] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DraftServer:
    """``python -m k3_accel.server.cli --engine ENGINE`` on loopback, waited for via /readyz."""

    def __init__(self, port: int | None = None, *extra: str, engine: str = "ngram"):
        self.port = port or free_port()
        self.engine = engine
        self.http_port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "DraftServer":
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "k3_accel.server.cli", "--engine", self.engine, "--host", "127.0.0.1",
               "--port", str(self.port), "--http-port", str(self.http_port), "--log-level", "WARNING",
               *self.extra]
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"draft server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("draft server not ready in time")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class Relay:
    """ROUTER (client side) <-> DEALER (server side) forwarder that can be paused.

    While paused it reads nothing from the client, so large zero-copy frames
    stay queued inside the client's libzmq. Every forwarded request's tensor
    frames are hashed into ``seen`` as ``(seq, op, [blake2b of each frame])``.
    """

    def __init__(self, server_address: str):
        import msgpack
        self._msgpack = msgpack
        self.port = free_port()
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.RCVHWM, 1)
        self.front.setsockopt(zmq.RCVBUF, 64 * 1024)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://127.0.0.1:{self.port}")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(server_address)
        self.paused = threading.Event()
        self.stop_flag = threading.Event()
        self.seen: list[tuple[int, str, list[str]]] = []
        self._idents: collections.deque[bytes] = collections.deque()   # one per forwarded request
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            if not self.paused.is_set() and self.front.poll(5):
                frames = self.front.recv_multipart()
                self._idents.append(frames[0])
                header = self._msgpack.unpackb(frames[1], raw=False)
                digests = [hashlib.blake2b(f, digest_size=16).hexdigest() for f in frames[2:]]
                self.seen.append((header["seq"], header["op"], digests))
                self.back.send_multipart(frames[1:])
            while self.back.poll(0 if not self.paused.is_set() else 5):
                self.front.send_multipart([self._idents.popleft(), *self.back.recv_multipart()])
            if self.paused.is_set():
                time.sleep(0.005)

    def close(self) -> None:
        self.stop_flag.set()
        self.thread.join(5)
        self.front.close()
        self.back.close()
        self.ctx.term()


def digest(t: torch.Tensor) -> str:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def settings(address: str, **kw) -> ClientSettings:
    base = dict(address=address, timeout_ms=5000, max_rows=4096, num_speculative_tokens=4,
                backoff_initial_ms=20, backoff_max_ms=200)
    base.update(kw)
    return ClientSettings(**base)


def rows(req_ids, chunks, *, sampled=None, anchors=None, k=4, prompts=None) -> StepInput:
    """A StepInput from per-request ``(start_position, [token ids])`` chunks.

    ``anchors[i]`` is the anchor token of request i (its position is the end
    of its chunk); default: the chunk's last token + 1.
    """
    counts = [len(toks) for _, toks in chunks]
    positions = torch.cat([torch.arange(s, s + len(t), dtype=torch.int64) for s, t in chunks]) \
        if chunks else torch.empty(0, dtype=torch.int64)
    token_ids = torch.tensor([x for _, t in chunks for x in t], dtype=torch.int64)
    sampled = sampled if sampled is not None else [True] * len(req_ids)
    anchors = anchors if anchors is not None else [(t[-1] + 1 if t else 0) for _, t in chunks]
    return StepInput(list(req_ids), counts, positions, token_ids, sampled, anchors,
                     [s + len(t) for s, t in chunks], k=k, prompt_token_ids=prompts)


@pytest.fixture
def server():
    srv = DraftServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def client_factory():
    made: list[DraftClient] = []

    def make(address: str, **kw) -> DraftClient:
        client = DraftClient(settings(address, **kw)).start()
        made.append(client)
        return client
    yield make
    for client in made:
        client.close()


def test_server_helper_answers_hello(server, client_factory):
    client = client_factory(server.address)
    assert client.state.value == "ready"
    assert client.caps.engine == "ngram"


def test_relay_forwards_and_hashes(server, client_factory):
    relay = Relay(server.address)
    try:
        client = client_factory(relay.address)
        assert client.state.value == "ready"
        assert [op for _, op, _ in relay.seen] == ["hello"]
    finally:
        relay.close()
