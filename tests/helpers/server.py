"""``k3-draft-server`` as a child process on free loopback ports, through the project's one launcher."""
from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3_accel.demo.server import DraftServer

from .ports import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")


def src_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that must import this checkout's ``k3_accel``."""
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class ServerProcess(DraftServer):
    """The draft server launcher (:class:`k3_accel.demo.server.DraftServer`) with this checkout's
    ``k3_accel``, quiet unless asked, started at once (``ready``: waiting for ``/readyz``), plus
    what tests inspect: metrics, bytes queued on its port, pausing every thread."""

    def __init__(self, *args: str, port: int | None = None, ready: bool = True, quiet: bool = True,
                 capture: bool = False):
        if quiet and "--log-level" not in args:
            args = (*args, "--log-level", "WARNING")
        super().__init__(args, port=port, env=src_env(), capture=capture)
        self.start(ready)

    def start(self, ready: bool = True) -> "ServerProcess":
        return super().start() if ready else self.launch()

    def wait_ready(self, timeout: float = 120) -> None:
        self._wait_ready(timeout)

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
        self.signal(signal.SIGCONT)

    def restart(self) -> "ServerProcess":
        """Kill and start again on the same ZMQ port (a new server_id)."""
        self.kill()
        self.http_port = free_port()
        return self.start()

    def stop(self) -> int:
        """SIGTERM (after SIGCONT, in case it is paused); its exit status."""
        return self.close(timeout=30)
