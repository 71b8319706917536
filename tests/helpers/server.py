"""``k3-draft-server`` as a child process on free loopback ports (the one launcher of the suite)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .ports import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")
BIND_ATTEMPTS = 3


def src_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that must import this checkout's ``k3_accel``."""
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class ServerProcess:
    """``python -m k3_accel.server.cli ARGS`` on free loopback ports; waits for ``/readyz``."""

    def __init__(self, *args: str, port: int | None = None, ready: bool = True, quiet: bool = True,
                 capture: bool = False):
        self.args = args
        self.port, self.http_port = port or free_port(), free_port()
        self.capture = capture
        self.proc: subprocess.Popen | None = None
        self.quiet = quiet
        for attempt in range(BIND_ATTEMPTS):
            try:
                self.start(ready)
                return
            except RuntimeError:
                # a port free when picked can be taken by another process before the server binds
                # it (the suite starts many servers): new ports, unless the caller chose one
                if port is not None or attempt == BIND_ATTEMPTS - 1:
                    raise
                self.port, self.http_port = free_port(), free_port()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, ready: bool = True) -> "ServerProcess":
        cmd = [sys.executable, "-m", "k3_accel.server.cli", "--port", str(self.port),
               "--http-port", str(self.http_port), *self.args]
        if self.quiet and "--log-level" not in self.args:
            cmd += ["--log-level", "WARNING"]
        out = subprocess.PIPE if self.capture else None
        self.proc = subprocess.Popen(cmd, env=src_env(), stdout=out, stderr=subprocess.STDOUT if out else None,
                                     text=True)
        if ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.proc.stdout.read() if self.capture else ""
                raise RuntimeError(f"server exited {self.proc.returncode}: {output}")
            try:
                if http_get(self.http_port, "/readyz", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("draft server did not become ready")

    def metrics(self) -> str:
        return http_get(self.http_port, "/metrics")[1]

    def queued_bytes(self) -> int:
        """Bytes that arrived on the server's ZMQ port and wait in the kernel, unread
        (``/proc/net/tcp``): messages sent to a paused server are there once this reaches
        their size."""
        total = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    lines = f.readlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                local, state, queues = fields[1], fields[3], fields[4]
                if int(local.rsplit(":", 1)[1], 16) == self.port and state == "01":   # ESTABLISHED
                    total += int(queues.split(":")[1], 16)
        return total

    def wait_queued(self, nbytes: int, timeout: float = 60) -> None:
        """Wait until at least ``nbytes`` wait unread on the server's port (see :meth:`queued_bytes`)."""
        deadline = time.monotonic() + timeout
        while self.queued_bytes() < nbytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.queued_bytes()} of {nbytes} bytes reached the server")
            time.sleep(0.01)

    def pause(self, timeout: float = 60) -> None:
        """SIGSTOP, and wait until every thread of the server has stopped."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not self._stopped():
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not stop")
            time.sleep(0.005)

    def _stopped(self) -> bool:
        task = Path(f"/proc/{self.proc.pid}/task")
        states = []
        for t in task.iterdir():
            try:
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue                   # a thread that just ended
        return bool(states) and all(s in "tT" for s in states)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def restart(self) -> "ServerProcess":
        """Kill and start again on the same ports (a new server_id)."""
        self.kill()
        self.http_port = free_port()
        return self.start()

    def stop(self) -> int:
        """SIGTERM (after SIGCONT, in case it is paused); its exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
