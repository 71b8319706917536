"""``--ipc-path``: the server also listens on a unix socket; startup bind errors."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers.oracles import ngram_lookup
from helpers.server import ServerProcess, src_env
from helpers.steps import settings, step
from helpers.wire import Wire
from k3_accel import protocol as p
from k3_accel.transport.client import DraftClient
from k3_accel.transport.link import State


@pytest.fixture
def ipc_path():
    with tempfile.TemporaryDirectory(dir="/tmp") as d:      # short: unix socket paths are limited
        yield Path(d) / "draft.sock"


def test_ipc_and_tcp_serve_the_same_server(ipc_path):
    ipc_path.write_text("stale")                            # a leftover file does not stop the server
    server = ServerProcess("--engine", "ngram", "--ipc-path", str(ipc_path))
    local, remote = Wire(f"ipc://{ipc_path}"), None
    try:
        local.ingest([(0, 0, [1, 2, 3, 1, 2])]).raise_for_error()
        remote = Wire(server.address, session=local.session)          # the same session over tcp
        got = remote.propose(4, [(0, 5, [], 3)]).raise_for_error().tensors["drafts"].tolist()
        assert got == [ngram_lookup([1, 2, 3, 1, 2, 3], 4) + [-1]]
        history = [5, 6, 7, 5, 6, 7, 5]
        with DraftClient(settings(f"ipc://{ipc_path}")) as client:   # the real transport client
            assert client.state is State.READY
            out = client.step(step(["a"], [(0, history)], anchors=[6], k=4))
            want = ngram_lookup(history + [6], 4)
            assert out.drafts.tolist() == [want + [-1] * (4 - len(want))]
    finally:
        local.close()
        if remote is not None:
            remote.close()
        assert server.stop() == 0
    assert not ipc_path.exists()                                     # the socket file is removed


def test_a_taken_port_fails_startup_with_a_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", "--engine", "ngram", "--port", str(port),
                              "--http-port", "0"], capture_output=True, text=True, env=src_env(), timeout=300)
    assert run.returncode == 1 and f"cannot bind tcp://127.0.0.1:{port}" in run.stderr, run.stderr


def test_a_taken_http_port_fails_startup_with_a_message_naming_the_flag():
    """Two servers on one host both take --http-port 8095 unless told otherwise: the second one
    says which port and flag, as for the ZMQ port, instead of dying in a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", "--engine", "ngram", "--port", "0",
                              "--http-port", str(port)], capture_output=True, text=True, env=src_env(), timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"127.0.0.1:{port}" in run.stderr and "--http-port" in run.stderr, run.stderr


@pytest.mark.parametrize("path, needle", [("/no/such/dir/x.sock", "existing directory"),
                                          ("/tmp/" + "x" * 120, "unix socket limit")])
def test_ipc_path_is_checked(path, needle, capsys):
    from k3_accel.server.cli import build_parser, validate
    ap = build_parser()
    with pytest.raises(SystemExit) as info:
        validate(ap.parse_args(["--ipc-path", path]), ap)
    assert info.value.code == 2 and needle in capsys.readouterr().err
    assert not os.path.exists(path)


def test_an_ipc_path_a_running_server_listens_on_fails_startup_and_that_server_keeps_it(ipc_path):
    """libzmq binds a unix socket path over a live listener without a word: a second server given
    the first's --ipc-path took the path from it (local clients reached the wrong server) and removed
    the socket file on its way out. It fails startup like a taken port does; the first keeps serving."""
    first = ServerProcess("--engine", "ngram", "--ipc-path", str(ipc_path))
    local = None
    try:
        run = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", "--engine", "ngram", "--port", "0",
                              "--http-port", "0", "--ipc-path", str(ipc_path)],
                             capture_output=True, text=True, env=src_env(), timeout=120)
        assert run.returncode == 1 and f"cannot bind ipc://{ipc_path}" in run.stderr, run.stderr
        remote = Wire(first.address)
        local = Wire(f"ipc://{ipc_path}")
        assert local.call(p.Ping()).server_id == remote.call(p.Ping()).server_id     # still the first server
        remote.close()
    finally:
        if local is not None:
            local.close()
        assert first.stop() == 0
