"""A ``k3-draft-server`` child process on loopback ports, for the demo and the e2e tests.

The handle can signal the process (kill, stop, continue) and restart it on
the same ports, so a target keeps its configured address across a restart.
On Linux the server dies with its parent (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence


class ServerStartError(RuntimeError):
    """The draft server exited or did not become ready; the message holds its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class DraftServer:
    """``python -m k3_accel.server.cli ARGS`` with fixed loopback ports."""

    def __init__(self, args: Sequence[str], log_path: str | Path, port: int | None = None,
                 http_port: int | None = None):
        self.args = list(args)
        self.port, self.http_port = port or free_port(), http_port or free_port()
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 120) -> "DraftServer":
        cmd = [sys.executable, "-m", "k3_accel.server.cli", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", str(self.http_port), *self.args]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent if os.name == "posix" else None)
        finally:
            log.close()
        self.starts += 1
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/readyz"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"draft server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http_status(url) == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.close()
        raise ServerStartError(f"draft server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap (a crash: no goodbye on the wire)."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def restart(self, timeout: float = 120) -> "DraftServer":
        self.close()
        return self.start(timeout)

    def close(self, timeout: float = 15) -> int | None:
        """Stop the server (SIGCONT first, in case it is stopped); returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode

    def __enter__(self) -> "DraftServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
