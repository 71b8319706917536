"""The server's reads over the device plane and the engine's stream on a GPU: a read's buffer is
never memory the engine's queued work still reads, before or after the read.

The engine's stream is held busy by a spin, as a long propose holds it; the read (on its own
stream, ordered only after the target's ready event) must not write into a block the engine freed
on the host while its queued work still reads it, and a block that held a read must not be handed
to the next read before the engine's work on it has run. Values only; no time is asserted.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from k3_accel.server.device_plane import Imported, ServerDevicePlane

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
ROWS, WIDTH = 64, 256
SPIN = int(2e8)                    # cycles the engine's stream stays busy (about 0.1 s)


def imported(value: float) -> Imported:
    slot = torch.full((ROWS, WIDTH), value, dtype=torch.bfloat16, device=DEV)
    ready = torch.cuda.Event(interprocess=True)
    ready.record()
    return Imported(b"conn", DEV, [slot], [ready], [torch.cuda.Event(interprocess=True)],
                    torch.cuda.Stream(DEV), WIDTH, "bfloat16")


def read(plane: ServerDevicePlane, imp: Imported):
    return plane._read(imp, 0, np.array([0]), np.array([ROWS]), ROWS)


def row_sums(t: torch.Tensor) -> torch.Tensor:
    return t.float().sum(dim=1)


def test_a_read_never_lands_in_memory_the_engine_freed_but_still_reads():
    home = torch.cuda.Stream(DEV)
    plane = ServerDevicePlane("auto", DEV, True, home)
    imp = imported(3.0)
    with torch.cuda.stream(home):
        engine_buf = torch.full((ROWS, WIDTH), 7.0, dtype=torch.bfloat16, device=DEV)
        torch.cuda._sleep(SPIN)
        seen = row_sums(engine_buf)               # queued behind the spin
    del engine_buf                                # freed on the host; the engine's read is still queued
    fetch = read(plane, imp)
    torch.cuda.synchronize()
    assert torch.equal(seen, torch.full((ROWS,), 7.0 * WIDTH, device=DEV))
    assert torch.equal(fetch.hidden, imp.slots[0]) and not fetch.nonfinite.any()


def test_a_read_buffer_is_not_reused_while_the_engine_still_reads_it():
    home = torch.cuda.Stream(DEV)
    plane = ServerDevicePlane("auto", DEV, True, home)
    imp = imported(5.0)
    first = read(plane, imp)
    torch.cuda.synchronize()
    with torch.cuda.stream(home):                 # the engine reads the first message's rows late
        torch.cuda._sleep(SPIN)
        seen = row_sums(first.hidden)
    del first                                     # the message is handled; its rows are dropped
    imp.slots[0].fill_(-1.0)                      # the target writes the slot's next step
    imp.ready[0].record()
    second = read(plane, imp)
    torch.cuda.synchronize()
    assert torch.equal(seen, torch.full((ROWS,), 5.0 * WIDTH, device=DEV))
    assert torch.equal(second.hidden, imp.slots[0])
