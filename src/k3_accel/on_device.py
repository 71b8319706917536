"""The engine's device and stream made current for a ``with`` block, and restored after.

What ``torch.cuda.device(d)`` inside ``torch.cuda.stream(s)`` does for one known device and
stream, without their generic checks: on a slow host core the pair (in an ExitStack) took
about 34 us to enter and 10 to leave, every propose (benchmarks/graph_run_steps.py).
A new object per ``with``, so blocks nest.
"""
from __future__ import annotations

import torch


class OnDevice:
    __slots__ = ("index", "stream", "_device", "_stream")

    def __init__(self, index: int, stream: torch.cuda.Stream):
        self.index, self.stream = index, stream

    def __enter__(self) -> None:
        self._device = torch.cuda.current_device()
        if self._device != self.index:
            torch.cuda.set_device(self.index)
        self._stream = torch.cuda.current_stream(self.index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self._stream)
        if self._device != self.index:
            torch.cuda.set_device(self._device)
