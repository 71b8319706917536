"""CUDA graphs of the propose step, one per (batch bucket, draft tokens, stored rows).

A graph reads one static int32 input buffer (anchors, context lengths, block
tables ``[bucket, width]``, padded: see :meth:`DFlashEngine.host_inputs`) and
writes ``[bucket, k]`` draft ids. A decode step's context rows are stored in the same
replay: a graph of ``rows`` > 0 first projects and stores up to ``rows`` waiting context
rows (the engine's pending ingest: the accepted rows of each request), whose positions and
slots follow the tables in the input buffer and whose hidden rows are in one device buffer
shared by every graph; padding rows go to the cache's trash slot, which no table names.
Per bucket ``b`` the row capacities are ``b``, ``2b``, ``4b`` .. up to ``b (k + 1)``
rounded up to a power of two; more rows are stored eagerly first. An engine that samples
(``caps.sampling``: DSpark) also reads each row's temperature (0: greedy, the draft is the argmax)
and seed. A replay is one
host-to-device copy from a pinned buffer, the replay, one device-to-host copy of the ids into pinned
memory and an event after it: whoever needs the ids waits on that event, the
step's only host synchronisation (the server reads its socket meanwhile). Graphs
share one memory pool; those of the engine's ``graph_k`` are captured at start, largest
bucket first, and any other on its first use, alone.

Every replay gets its own pinned buffers and event (PyTorch's caching host allocator hands a
freed one out again only once its copies are done): the server launches one replay per group
of a batch (one per ``k``) before it reads any, and a test compares a greedy and a sampled
replay afterwards. Shared buffers let the later replay overwrite the earlier one's drafts
(and the inputs of a copy still in flight).
"""
from __future__ import annotations

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
    inputs: torch.Tensor      # device int32 buffer the graph reads
    tokens: torch.Tensor      # device [bucket, k] int64 the graph writes
    confidence: torch.Tensor | None = None   # device [bucket, k] float32 (engines with confidence)
    temperature: torch.Tensor | None = None  # device [bucket] float32 (engines that sample)
    seeds: torch.Tensor | None = None        # device [bucket] int64
    rows: int = 0             # context rows stored before drafting (0: none)


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

    def _host(self, n: int, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        """A host buffer of this replay alone (pinned on CUDA); zeroed unless the replay's copy
        overwrites all of it."""
        make = torch.zeros if zero else torch.empty
        return make(n, dtype=dtype, pin_memory=self.cuda)

    @torch.inference_mode()
    def capture(self, k: int) -> None:
        """Every graph of ``k`` draft tokens (at start; a graph not captured yet is captured on
        its first use, alone)."""
        for bucket in reversed(self.buckets):
            for rows in (0,) + self.row_caps(bucket, k):
                self._capture(bucket, k, rows)

    def _capture(self, bucket: int, k: int, rows: int) -> _Graph:
        eng = self.engine
        base = bucket * (2 + self.width)
        inputs = torch.zeros(base + 2 * rows, dtype=torch.int32, device=eng.device)
        batch = eng.device_batch(inputs[:base], bucket, self.width, k)
        if eng.caps.sampling:
            batch.temperature = torch.zeros(bucket, dtype=torch.float32, device=eng.device)
            batch.seeds = torch.zeros(bucket, dtype=torch.int64, device=eng.device)
        store = None
        if rows:
            inputs[base + rows:] = eng.cache.trash_slot
            store = (inputs[base:base + rows], inputs[base + rows:], self.hidden[:rows])
        graph, out = self._record(batch, store)
        tokens, confidence = out if isinstance(out, tuple) else (out, None)
        g = self.graphs[(bucket, k, rows)] = _Graph(graph, inputs, tokens, confidence, batch.temperature,
                                                    batch.seeds, rows)
        self.captured_k.add(k)
        return g

    def _record(self, batch: Any, store: tuple | None) -> tuple[Any, Any]:
        """The graph of ``engine.step(batch, store)`` (anything with ``replay()``) and its outputs."""
        eng = self.engine
        with eng._on_device():                     # warm up: Triton JIT, cuBLAS plans
            eng.step(batch, store)
        eng.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, stream=eng.stream,
                              capture_error_mode="thread_local"):
            out = eng.step(batch, store)
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
        base = bucket * (2 + self.width)
        host_in = self._host(base + 2 * rows, torch.int32, zero=False)   # every entry read is written
        eng.host_inputs(anchors, states, bucket, self.width, out=host_in.numpy()[:base])
        if rows:
            self._take_rows(host_in.numpy()[base:].reshape(2, rows))
        g.inputs.copy_(host_in, non_blocking=True)
        if g.temperature is not None:              # padding rows: temperature 0, seed 0
            temp, seeds = self._host(bucket, torch.float32), self._host(bucket, torch.int64)
            if batch is not None and batch.temperature is not None:
                temp[:r] = batch.temperature
                seeds[:r] = batch.seeds
            g.temperature.copy_(temp, non_blocking=True)
            g.seeds.copy_(seeds, non_blocking=True)
        g.graph.replay()
        out = self._host(bucket * k, torch.int64, zero=False).view(bucket, k)
        out.copy_(g.tokens, non_blocking=True)
        conf = None
        if g.confidence is not None:
            conf = self._host(bucket * k, torch.float32, zero=False).view(bucket, k)
            conf.copy_(g.confidence, non_blocking=True)
            conf = conf[:r]
        done = None
        if eng.stream is not None:
            done = torch.cuda.Event()
            done.record(eng.stream)
        return out[:r], done, conf

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
