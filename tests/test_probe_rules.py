"""``k3-accel probe ADDRESS``: hello + stats from a running draft server, and a clear failure
otherwise: exit 1 with the reason when nothing answers or when the server answers with an
error (an incompatible peer), never a 0 that a health script would take for "up"."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
import zmq

from helpers.server import SRC
from k3_accel import protocol as p
from k3_accel.demo.probe import ProbeError, probe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3_accel.cli", *args], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})


def test_probe_of_an_address_nobody_serves_exits_1_and_says_why():
    address = f"tcp://127.0.0.1:{_free_port()}"
    out = _cli("probe", address, "--timeout-ms", "300")
    assert out.returncode == 1, out
    assert address in out.stderr and "no reply to hello" in out.stderr
    assert out.stdout == ""


@pytest.fixture
def refusing_peer():
    """A peer that answers every request with an error reply (a server that refuses this client)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                ident, *frames = sock.recv_multipart()
                req = p.decode_request(frames)
                reply = p.error_reply(req.seq, "refuser", p.ErrorCode.NOT_OWNER, "this session belongs to another key")
                sock.send_multipart([ident, *p.encode_reply(reply)])
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{port}"
    stop.set()
    t.join(5)
    sock.close(0)
    ctx.term()


def test_probe_reports_an_error_reply_as_an_error(refusing_peer):
    with pytest.raises(ProbeError, match="NOT_OWNER"):
        probe(refusing_peer, 2000)
    out = _cli("probe", refusing_peer, "--timeout-ms", "2000")
    assert out.returncode == 1 and "NOT_OWNER" in out.stderr
