"""CUDA graphs of the propose step, one per (batch bucket, draft tokens, stored rows).

A graph reads one static int32 input buffer (anchors, context lengths, block tables ``[bucket,
width]``, padded: see :meth:`DFlashEngine.host_inputs`) and writes ``[bucket, k]`` draft ids (and
their confidence) into one int32 output buffer. A decode step's context rows are stored in the same
replay: a graph of ``rows`` > 0 first projects and stores up to ``rows`` waiting context rows (the
engine's pending ingest: the accepted rows of each request), whose positions and slots follow the
tables in the input buffer and whose hidden rows are in one device buffer shared by every graph;
padding rows go to the cache's trash slot, which no table names. Per bucket ``b`` the row capacities
are ``b``, ``2b``, ``4b`` .. up to ``b (k + 1)`` rounded up to a power of two; more rows are stored
eagerly first. An engine that samples (``caps.sampling``: DSpark) also reads each row's temperature
(0: greedy, the draft is the argmax) and seed, at the head of the same input buffer. A replay is one
host-to-device copy from a pinned buffer, the replay, one device-to-host copy of its outputs into
pinned memory and an event after it: whoever needs the ids waits on that event, the step's only host
synchronisation (the server reads its socket meanwhile). Graphs share one memory pool; those of the
engine's ``graph_k`` are captured at start, largest bucket first, and any other on its first use,
alone.

Every replay gets its own pinned output buffer and event (PyTorch's caching host allocator hands a
freed one out again only once its copies are done): the server launches one replay per group
of a batch (one per ``k``) before it reads any, and a test compares a greedy and a sampled
replay afterwards. Shared buffers let the later replay overwrite the earlier one's drafts
(and the inputs of a copy still in flight). A graph's input buffer is used again once the
replay that last read it is done (its event): no input allocation on the host's path then.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import triton

from ..pool import BlockTable

if TYPE_CHECKING:
    from .engine import DFlashEngine

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor      # device int32 buffer the graph reads (see GraphRunner._capture)
    out: torch.Tensor         # device int32 buffer the graph writes: ids (int64 [bucket, k]) | confidence
    bucket: int
    k: int
    rows: int = 0             # context rows stored before drafting (0: none)
    sampled: bool = False     # reads temperatures and seeds (engines that sample)
    spare: Any = None         # the last replay's pinned input buffer, its NumPy view and its event

    @property
    def head(self) -> int:
        """int32 entries before the block inputs: seeds (int64) and temperatures (float32)."""
        return 3 * self.bucket if self.sampled else 0

    @property
    def confident(self) -> bool:
        """Whether confidence (float32 ``[bucket, k]``) follows the ids in the output buffer."""
        return self.out.shape[0] > 2 * self.bucket * self.k


class GraphRunner:
    def __init__(self, engine: "DFlashEngine", max_batch: int):
        self.engine = engine
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.captured_k: set[int] = set()
        self.cuda = engine.device.type == "cuda"
        self.mempool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._size()
        most = max(self.buckets) * max(self.row_caps(1, engine.caps.max_spec_tokens), default=0)
        # the rows a replay stores; one buffer for every graph, sized once (a graph reads the one it saw)
        self.hidden = torch.zeros(most, engine.caps.context_width, dtype=engine.dtype, device=engine.device)

    def row_caps(self, bucket: int, k: int) -> tuple[int, ...]:
        """Context rows a graph of ``(bucket, k)`` may store: ``bucket`` x 1, 2, 4 .. (k + 1)
        (none where a slot number does not fit the int32 input buffer)."""
        if self.engine.cache.trash_slot >= 2**31:
            return ()
        caps, m = [], 1
        while True:
            caps.append(bucket * m)
            if m >= k + 1:
                return tuple(caps)
            m *= 2

    def _size(self) -> None:
        eng = self.engine
        rows = eng.pool.block_rows
        self.width = min(eng.pool.num_blocks, triton.cdiv(eng.weights.cos_sin.shape[0], rows))

    def reset(self) -> None:
        """Forget every graph (the RoPE table moved); captured k values come back lazily."""
        self.graphs.clear()
        self._size()

    def _host(self, n: int) -> torch.Tensor:
        """An int32 host buffer of this replay alone (pinned on CUDA), not zeroed."""
        return torch.empty(n, dtype=torch.int32, pin_memory=self.cuda)

    @torch.inference_mode()
    def capture(self, k: int) -> None:
        """Every graph of ``k`` draft tokens (at start; a graph not captured yet is captured on
        its first use, alone)."""
        for bucket in reversed(self.buckets):
            for rows in (0,) + self.row_caps(bucket, k):
                self._capture(bucket, k, rows)

    def _capture(self, bucket: int, k: int, rows: int) -> _Graph:
        """One graph. Its int32 input buffer: ``[seeds (int64) | temperatures (float32)]`` (engines
        that sample), the block inputs of :meth:`DFlashEngine.host_inputs`, then the stored rows'
        positions and slots; its output buffer: the ids (int64), then their confidence (float32)."""
        eng = self.engine
        g = _Graph(None, None, None, bucket, k, rows, sampled=eng.caps.sampling)
        h, base = g.head, bucket * (2 + self.width)
        g.inputs = inputs = torch.zeros(h + base + 2 * rows, dtype=torch.int32, device=eng.device)
        batch = eng.device_batch(inputs[h:h + base], bucket, self.width, k)
        if g.sampled:
            batch.seeds = inputs[:2 * bucket].view(torch.int64)
            batch.temperature = inputs[2 * bucket:h].view(torch.float32)
        store = None
        if rows:
            inputs[h + base + rows:] = eng.cache.trash_slot
            store = (inputs[h + base:h + base + rows], inputs[h + base + rows:], self.hidden[:rows])

        def step() -> torch.Tensor:
            out = eng.step(batch, store)
            ids, confidence = out if isinstance(out, tuple) else (out, None)
            ids = ids.reshape(-1).view(torch.int32)
            return ids if confidence is None else torch.cat([ids, confidence.reshape(-1).view(torch.int32)])

        g.graph, g.out = self._record(step, rows)
        self.graphs[(bucket, k, rows)] = g
        self.captured_k.add(k)
        return g

    def _record(self, step: Any, rows: int) -> tuple[Any, torch.Tensor]:
        """The graph of ``step()`` (anything with ``replay()``) and what it returns; ``rows``: the
        context rows it stores."""
        eng = self.engine
        with eng._on_device():                     # warm up: Triton JIT, cuBLAS plans
            step()
        eng.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()              # no collection mid-capture: a collected graph or event (another
        try:                      # engine's) calls CUDA on this thread, which voids the capture
            with torch.cuda.graph(graph, pool=self.mempool, stream=eng.stream,
                                  capture_error_mode="thread_local"):
                out = step()
        finally:
            if collecting:
                gc.enable()
        return graph, out

    def run(self, anchors: torch.Tensor, states: list[BlockTable], k: int, batch: Any = None
            ) -> tuple[torch.Tensor, torch.cuda.Event, torch.Tensor | None] | None:
        """Draft ids ``[R, k]`` in pinned host memory, the event after which they are
        there and their confidence (or None), or None when no graph fits (the caller runs
        the step eagerly). ``batch``: the ``ProposeBatch`` (its temperatures and seeds).
        The engine's waiting context rows are stored in the replay when a graph holds them
        all, else eagerly before it. The host buffers are this call's own: later calls
        leave them alone. Call on the engine's stream."""
        r = len(states)
        bucket = next((b for b in self.buckets if b >= r), None)
        if bucket is None or max(len(s.blocks) for s in states) > self.width:
            return None
        eng = self.engine
        waiting = eng.pending_rows
        rows = next((c for c in self.row_caps(bucket, k) if c >= waiting), None) if waiting else 0
        if rows is None:
            eng.flush()
            rows = 0
        g = self.graphs.get((bucket, k, rows)) or self._capture(bucket, k, rows)
        h, base = g.head, bucket * (2 + self.width)
        if g.spare is not None and g.spare[2].query():   # the last replay's copies are done
            host, buf, _ = g.spare
        else:
            host = self._host(g.inputs.shape[0])  # every entry read is written
            buf = host.numpy()
        eng.host_inputs(anchors, states, bucket, self.width, out=buf[h:h + base])
        if g.sampled:                              # padding rows: temperature 0 (greedy), seed 0
            seeds, temperature = buf[:2 * bucket].view(np.int64), buf[2 * bucket:h].view(np.float32)
            sampled = batch is not None and batch.temperature is not None
            temperature[:r] = batch.temperature.numpy() if sampled else 0
            seeds[:r] = batch.seeds.numpy() if sampled else 0
            temperature[r:], seeds[r:] = 0, 0
        if rows:
            self._take_rows(buf[h + base:].reshape(2, rows))
        g.inputs.copy_(host, non_blocking=True)
        g.graph.replay()
        out = self._host(g.out.shape[0])
        out.copy_(g.out, non_blocking=True)
        n, o = bucket * k, out.numpy()            # views through NumPy: a third of torch's cost
        ids = torch.from_numpy(o[:2 * n].view(np.int64).reshape(bucket, k)[:r])
        conf = torch.from_numpy(o[2 * n:].view(np.float32).reshape(bucket, k)[:r]) if g.confident else None
        done = None
        if eng.stream is not None:
            done = torch.cuda.Event()
            done.record(eng.stream)
            g.spare = (host, buf, done)
        return ids, done, conf

    def _take_rows(self, index: np.ndarray) -> None:
        """The engine's waiting rows into this replay: positions and slots into ``index``
        ``[2, rows]`` (padding: position 0, the trash slot), hidden rows into ``self.hidden``."""
        n = 0
        for positions_slots, hidden in self.engine.take_pending():
            m = positions_slots.shape[1]
            index[:, n:n + m] = positions_slots
            self.hidden[n:n + m].copy_(hidden, non_blocking=True)
            n += m
        index[0, n:] = 0
        index[1, n:] = self.engine.cache.trash_slot
