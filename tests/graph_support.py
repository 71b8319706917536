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

    def _record(self, batch, store):
        out = self.engine.step(batch, store)
        static = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]

        def replay():
            self.replayed.append(store[0].shape[0] if store is not None else 0)
            new = self.engine.step(batch, store)
            fresh = [t for t in (new if isinstance(new, tuple) else (new,)) if t is not None]
            for s, f in zip(static, fresh, strict=True):
                s.copy_(f)
        return SimpleNamespace(replay=replay), out

    def _host(self, n, dtype, zero=True):
        """A buffer not zeroed holds what its last user left: here ids far past the pool (NaN
        for floats), so a step that read past what ``host_inputs`` writes would fail or differ."""
        buf = super()._host(n, dtype, zero)
        if not zero:
            buf.fill_(float("nan") if dtype.is_floating_point else 2 ** 30)
        return buf
