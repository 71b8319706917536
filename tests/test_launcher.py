"""The one draft-server launcher (``k3_accel.demo.server.DraftServer``): ports it picked are picked
again when another process takes one before the server binds it; ports a caller chose are not."""
from __future__ import annotations

import socket

import pytest

import k3_accel.demo.server as launcher
from helpers.server import src_env


def test_a_picked_port_taken_before_the_server_binds_is_picked_again(monkeypatch, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    real, picks = launcher.free_port, []

    def free_port() -> int:                # the first pick is a port someone else holds
        picks.append(busy if not picks else real())
        return picks[-1]
    monkeypatch.setattr(launcher, "free_port", free_port)
    server = launcher.DraftServer(["--engine", "ngram"], tmp_path / "log", env=src_env())
    try:
        assert server.port == busy
        server.start(timeout=120)
        assert server.port != busy and server.starts == 2 and server.proc.poll() is None
    finally:
        assert server.close() == 0
    chosen = launcher.DraftServer(["--engine", "ngram"], tmp_path / "log2", port=busy, env=src_env())
    with pytest.raises(launcher.ServerStartError):
        chosen.start(timeout=120)
    assert chosen.starts == 1 and chosen.port == busy
    taken.close()


def test_a_restart_keeps_its_ports(tmp_path):
    """A target keeps its configured address across a restart: a port held by someone else
    then is an error, not a move to other ports."""
    server = launcher.DraftServer(["--engine", "ngram"], tmp_path / "log", env=src_env()).start(timeout=120)
    port = server.port
    server.kill()
    taken = socket.socket()
    taken.bind(("127.0.0.1", port))
    taken.listen()
    try:
        with pytest.raises(launcher.ServerStartError):
            server.start(timeout=120)
        assert server.port == port and server.starts == 2
    finally:
        taken.close()
        server.close()
    assert server.restart(timeout=120).port == port
    assert server.close() == 0
