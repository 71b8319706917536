"""P6's watchdog: a ``generate`` that makes no progress for ``WATCHDOG_S`` dumps every process's
stacks and kills vLLM's engine core, so that the run goes on to what is left (``e2e_p6.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

WATCHDOG_S = 90.0      # a generate of at most 32 x 128 tokens takes seconds; past this it is stuck
SPARE: set[int] = set()  # child pids the watchdog leaves alive (the draft server)


def stuck(seconds: float) -> None:
    """The watchdog: every thread's stack here and, through benchmarks/gpu/stacks/sitecustomize.py,
    in every child (vLLM's engine core, the draft server); then the engine core is killed so
    that generate raises and the run goes on to what is left."""
    import faulthandler
    import signal
    print(f"WATCHDOG: generate made no progress for {seconds:.0f} s; stacks follow", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    children = _descendants(os.getpid())          # vLLM's engine core is a grandchild (its process manager)
    for pid in children:
        if _catches_usr1(pid):          # never a signal that would kill it
            os.kill(pid, signal.SIGUSR1)
    time.sleep(5)
    for pid in children:
        if pid not in SPARE and not SPARE & set(_ancestors(pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in _descendants(k)]


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        chain.append(pid)
    return chain


def _catches_usr1(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> 9 & 1)     # SIGUSR1 = 10
    except OSError:
        pass
    return False
