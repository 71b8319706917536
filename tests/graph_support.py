"""A CUDA-graph runner on the CPU: capture records the step over its static buffers (what a graph
reads: the input block, temperatures, seeds, the rows it stores); a replay reruns the step on whatever
those buffers hold then and copies the results into the captured outputs (what a graph writes)."""
from __future__ import annotations

from types import SimpleNamespace

from k3_accel.server.engines.dflash.graphs import GraphRunner


class SimulatedGraphs(GraphRunner):
    """Capture records the step over its static buffers; a replay reruns it on whatever those
    buffers hold then and copies the results into the captured outputs. ``replayed``: the rows
    each replay stored (0: a graph without rows)."""

    def __init__(self, engine, max_batch):
        self.replayed: list[int] = []
        super().__init__(engine, max_batch)

    def _record(self, step, rows):
        static = step()

        def replay():
            self.replayed.append(rows)
            static.copy_(step())
        return SimpleNamespace(replay=replay), static

    def _host(self, n):
        """A buffer not zeroed holds what its last user left: here 0x7FC00000 in every entry (an id
        far past the pool; NaN as a float32 temperature), so a step that read past what ``run``
        writes would fail or differ."""
        return super()._host(n).fill_(0x7FC00000)
