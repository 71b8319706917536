"""A ``k3-draft-server`` child process on loopback ports: the one launcher of the demo, the tests
and the benchmarks.

The handle can signal the process (kill, stop, continue) and restart it on
the same ports, so a target keeps its configured address across a restart.
On Linux the server dies with its parent (``PR_SET_PDEATHSIG``). A server
on the CPU runs one torch thread unless its flags say otherwise
(:func:`beside_its_client`).
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
from typing import Mapping, Sequence


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


BIND_ATTEMPTS = 3


def beside_its_client(args: Sequence[str]) -> list[str]:
    """The flags of a server launched here, on this machine's CPUs beside whatever drives it (a
    vLLM engine whose OpenMP threads take every core): ``--threads 1`` unless ``args`` set
    ``--threads`` or put the engine on a GPU. Two OpenMP teams on the same cores spin at their
    barriers against each other: on the 2-core box the server's ingest of one probe's held rows
    (512 rows) took 30 ms with torch's default threads, 2 ms on its own."""
    args = list(args)
    flags = {a.split("=", 1)[0] for a in args}
    device = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--device"), "cpu")
    device = next((a.split("=", 1)[1] for a in args if a.startswith("--device=")), device)
    if "--threads" in flags or device != "cpu":
        return args
    return [*args, "--threads", "1"]


class DraftServer:
    """``python -m k3_accel.server.cli ARGS`` on loopback ports (picked free unless given): the one
    launcher of the demo, the tests and the benchmarks. Its output goes to ``log_path`` (appended),
    to a pipe (``capture``) or to this process's own; ``env`` replaces the environment."""

    def __init__(self, args: Sequence[str], log_path: str | Path | None = None, port: int | None = None,
                 http_port: int | None = None, *, env: Mapping[str, str] | None = None, capture: bool = False):
        self.args = beside_its_client(args)
        self._picked = port is None and http_port is None
        self.port, self.http_port = port or free_port(), http_port or free_port()
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = dict(env) if env is not None else None
        self.capture = capture
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

    def launch(self) -> "DraftServer":
        """Start the process without waiting for it to be ready."""
        cmd = [sys.executable, "-m", "k3_accel.server.cli", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", str(self.http_port), *self.args]
        log = open(self.log_path, "ab") if self.log_path is not None else None
        out = log if log is not None else (subprocess.PIPE if self.capture else None)
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         stdin=subprocess.DEVNULL, env=self.env, text=self.capture,
                                         preexec_fn=_die_with_parent if os.name == "posix" else None)
        finally:
            if log is not None:
                log.close()
        self.starts += 1
        return self

    def start(self, timeout: float = 120) -> "DraftServer":
        """Launch and wait for ``/readyz``. On the first start, ports this handle picked are picked
        again when the server exits before it is ready (another process may take a free port before
        the server binds it); a restart keeps its ports (a target keeps its configured address)."""
        repick = self._picked and self.starts == 0
        for attempt in range(BIND_ATTEMPTS):
            self.launch()
            try:
                self._wait_ready(timeout)
                return self
            except ServerStartError:
                if not repick or attempt == BIND_ATTEMPTS - 1 or self.proc.poll() is None:
                    raise
                self.port, self.http_port = free_port(), free_port()
        raise AssertionError("unreachable")

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
            time.sleep(0.05)
        self.close()
        raise ServerStartError(f"draft server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The end of its output: the log file, or the pipe once the process has exited."""
        try:
            if self.log_path is not None:
                text = self.log_path.read_text(errors="replace")
            elif self.capture and self.proc is not None and self.proc.poll() is not None:
                text = self.proc.stdout.read()
            else:
                return ""
        except (OSError, ValueError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

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
