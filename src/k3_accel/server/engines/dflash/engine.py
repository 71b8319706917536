"""DFlashEngine: batched DFlash block drafting over one paged K/V pool.

* Memory: one pool (:mod:`.kv_cache`) sized at start from a byte budget or a
  fraction of free GPU memory; a request's state is a
  :class:`~..pool.BlockTable`. Rewind, fork and release edit tables only;
  forks share full blocks and copy a partial last one (copy on write).
* Ingest: all new rows of all items in one pass (one host-to-device copy of
  the hidden rows, one fc / norm / K-V projection, one scatter into the pool).
  Small ingests of host rows, or of device rows the server owns (read over
  the device plane), such as a target's decode steps that draft nothing,
  are *coalesced*: tables and the copy are done at once, the projection waits
  (up to ``coalesce_rows`` rows) for the next propose, fork, release, rewind
  or large ingest, so a target whose speculation is off costs the device one
  projection per many steps instead of one per step (:meth:`flush`).
* Propose: every request's query block goes through the layers together;
  attention reads each request's own paged context. Greedy argmax runs on
  the device and only ``[R, k]`` ids come back, unless logits are asked for.
  On CUDA, decode-shaped proposals replay CUDA graphs (:mod:`.graphs`), which
  also project and store the waiting rows (a decode step's accepted rows), so a
  decode step is one replay.
* All device work runs on an engine-owned CUDA stream, so any thread may call.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch

from k3_accel.on_device import OnDevice

from ..base import (DraftEngine, EngineCaps, EngineError, EngineFault, IngestBatch, ProposeBatch,
                    Proposal)
from ..pool import BlockTable, PoolExhausted
from . import ops_torch
from .host_tables import HostTables
from .kv_cache import KVCache, blocks_in_budget, bytes_per_row, cuda_budget
from .model import BlockBatch, block_logits, context_projection, fuse, greedy, rope_table, target_logits
from .weights import DFlashWeights, load_dflash

_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEFAULT_CPU_BUDGET = 256 << 20
DEFAULT_MEMORY_FRACTION = 0.8       # of the GPU memory free once weights are loaded
DEFAULT_COALESCE_ROWS = 1024        # host rows whose projection may wait for the next propose


def _dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def select_ops(kernels: str, device: torch.device, weights: DFlashWeights, block_rows: int) -> Any:
    """``"auto"``: fused Triton kernels on CUDA where the shapes allow, else PyTorch."""
    if kernels not in ("auto", "torch", "triton"):
        raise ValueError(f"kernels must be auto, torch or triton, got {kernels!r}")
    if kernels == "torch" or (kernels == "auto" and device.type != "cuda"):
        return ops_torch
    try:
        from . import ops_triton
    except ImportError:
        if kernels == "triton":
            raise
        return ops_torch
    why = ops_triton.unsupported(weights.config, block_rows, weights.dtype)
    if why and kernels == "triton":
        raise ValueError(f"the Triton kernels cannot run this draft: {why}")
    return ops_torch if why else ops_triton


WARM_INGEST_ROWS = (1, 2, 3, 16, 17)   # a step's row-count classes for Triton (see DFlashEngine._warm_ingest)


class DFlashEngine(DraftEngine):
    """DFlash block drafter over a draft checkpoint and its target's embed/lm_head.

    ``dtype`` defaults to bfloat16 on CUDA and float32 on the CPU. The pool holds
    ``budget_bytes`` (else ``memory_fraction`` of free GPU memory, else 256 MiB on
    the CPU) in blocks of ``block_size`` rows. See :meth:`_build` for the rest.
    """

    def __init__(self, draft_dir: str, target_dir: str, device: str = "cpu",
                 dtype: str | None = None, **options: Any):
        dev = torch.device(device)
        self._build(load_dflash(draft_dir, target_dir, _dtype(dtype, dev), dev), **options)

    @classmethod
    def from_weights(cls, weights: DFlashWeights, **options: Any) -> "DFlashEngine":
        """An engine over already loaded weights (their device and dtype)."""
        engine = cls.__new__(cls)
        engine._build(weights, **options)
        return engine

    def _build(self, weights: DFlashWeights, *, block_size: int = 16, budget_bytes: int | None = None,
               memory_fraction: float | None = None, max_spec_tokens: int | None = None,
               max_batch: int = 64, kernels: str = "auto", cuda_graphs: bool = True,
               graph_k: tuple[int, ...] | None = None, coalesce_rows: int = DEFAULT_COALESCE_ROWS) -> None:
        """``max_batch``: largest CUDA-graph batch bucket; ``graph_k``: numbers of draft
        tokens captured at start (default: ``max_spec_tokens``; others are captured on
        first use); ``kernels``: "auto", "triton" or "torch"; ``coalesce_rows``: rows of
        small host ingests whose projection may wait (0: every ingest computes at once)."""
        cfg = weights.config
        if max_spec_tokens is not None and max_spec_tokens < 0:
            raise ValueError(f"max_spec_tokens must be >= 0, got {max_spec_tokens}")
        self.config, self.device, self.dtype = cfg, weights.device, weights.dtype
        self.caps = self._caps(block_size, max_spec_tokens)
        self.ops = select_ops(kernels, self.device, weights, block_size)
        self.weights = fuse(weights)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._row_bytes = bytes_per_row(cfg, self.dtype)
        if budget_bytes is None:
            budget_bytes = (cuda_budget(self.device, memory_fraction or DEFAULT_MEMORY_FRACTION,
                                        self._workspace_bytes(max_batch))
                            if cuda else DEFAULT_CPU_BUDGET)
        elif memory_fraction is not None:
            raise ValueError("give budget_bytes or memory_fraction, not both")
        self.cache = KVCache(cfg, blocks_in_budget(budget_bytes, block_size, self._row_bytes),
                             block_size, self.dtype, self.device)
        self.pool = self.cache.pool
        self.host_tables = HostTables()
        self._splits = self._split_rule()
        self._stats: dict[str, float] = {"propose_seconds": 0.0, "propose_batch": 0,
                                         "ingest_seconds": 0.0, "ingest_rows": 0}
        self._ingest_events: tuple[Any, Any] | None = None
        if coalesce_rows < 0:
            raise ValueError(f"coalesce_rows must be >= 0, got {coalesce_rows}")
        self.coalesce_rows = coalesce_rows
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []    # (positions, slots [2, n]; hidden [n, W])
        self.pending_rows = 0         # rows whose projection is still waiting
        self.graphs = None
        if cuda and cuda_graphs and self.ops is not ops_torch:
            from .graphs import GraphRunner
            torch.cuda.current_stream(self.device).synchronize()
            self.graphs = GraphRunner(self, max_batch)
            for k in graph_k if graph_k is not None else (self.caps.max_spec_tokens,):
                if 0 < k <= self.caps.max_spec_tokens:
                    self.graphs.capture(k)
        self._warm_ingest()

    def _warm_ingest(self) -> None:
        """Run the eager ingest path once per row-count class before any client comes: Triton
        compiles a kernel anew for an integer equal to 1 or divisible by 16 and a pointer aligned
        to 16 bytes or not, and a step's row count decides both (one row per request at B = 1). On
        the H200 the first B = 1 request after a B = 32 warm-up got its replies seconds late and
        lost its context. Leaves the pool as it was."""
        for n in WARM_INGEST_ROWS:
            state = self.new_state()
            if self.pool.blocks_needed(state, 0, n) > self.pool.free_blocks:
                continue
            try:
                self.ingest(IngestBatch([state], [0], [n], torch.arange(n), torch.zeros(n, dtype=torch.int64),
                                        torch.zeros(n, self.config.context_width, dtype=self.dtype)))
            finally:
                self.release(state)
        if self.stream is not None:
            self.stream.synchronize()
        self._stats.update(ingest_seconds=0.0, ingest_rows=0)
        self._ingest_events = None

    def _caps(self, block_size: int, max_spec_tokens: int | None) -> EngineCaps:
        cfg, limit = self.config, self.config.block_size - 1
        return EngineCaps(
            kind="dflash", needs_hidden_states=True, context_width=cfg.context_width,
            supports_logits=True, supports_topk=True,
            max_spec_tokens=limit if max_spec_tokens is None else min(max_spec_tokens, limit),
            block_size=block_size, vocab_size=cfg.vocab_size, hidden_size=cfg.target_hidden_size,
            mask_token_id=cfg.mask_token_id, aux_layer_ids=tuple(cfg.target_layer_ids))

    def _workspace_bytes(self, max_batch: int) -> int:
        """Activation room kept out of the pool: logits and MLP rows of the largest batch."""
        cfg = self.config
        rows = max_batch * (self.caps.max_spec_tokens + 1)
        per_row = 4 * cfg.vocab_size + 6 * cfg.intermediate_size + 16 * cfg.hidden_size
        return 512 * 2**20 + rows * per_row * torch.empty((), dtype=self.dtype).element_size()

    def _split_rule(self):
        """Context splits of the Triton attention for ``R`` requests: enough programs
        (requests x kv heads x splits) to fill the device twice over."""
        if self.device.type != "cuda" or self.ops is ops_torch:
            return lambda r: 1
        from .triton_attention import MAX_SPLITS
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        nkv = self.config.num_kv_heads
        return lambda r: max(1, min(MAX_SPLITS, (2 * sms) // max(1, r * nkv)))

    def _on_device(self) -> contextlib.AbstractContextManager:
        if self.stream is None:
            return contextlib.nullcontext()
        return OnDevice(self.stream.device_index, self.stream)

    # ------------------------------------------------------------ state ---

    @property
    def bytes_per_row(self) -> int:
        return self._row_bytes

    def new_state(self) -> BlockTable:
        return BlockTable()

    def length(self, state: BlockTable) -> int:
        return state.length

    def table(self, state: BlockTable) -> BlockTable:
        return state

    def fork(self, state: BlockTable, length: int) -> BlockTable:
        self.flush()                                   # the copy of a partial block reads its rows
        try:
            with self._on_device():
                new = self.pool.fork(state, length, self.cache.copy_block)
        except PoolExhausted as exc:
            raise EngineError(EngineFault.CAPACITY, f"cannot fork {length} rows: {exc}") from exc
        self.host_tables.update(new)
        return new

    def release(self, state: BlockTable) -> None:
        self.flush()                                   # its blocks may be someone else's next
        self.pool.release(state)

    def _ensure_positions(self, n: int) -> None:
        """Grow the RoPE table to cover positions ``0..n-1`` (recaptures graphs)."""
        table = self.weights.cos_sin
        if n > table.shape[0]:
            with self._on_device():
                self.weights.cos_sin = rope_table(self.config, max(n, 2 * table.shape[0]),
                                                  self.dtype, self.device)
            if self.graphs is not None:
                self.graphs.reset()

    # ----------------------------------------------------------- ingest ---

    @torch.inference_mode()
    def ingest(self, batch: IngestBatch) -> None:
        start = time.perf_counter()
        items = list(zip(batch.states, batch.starts, batch.counts))
        need = sum(self.pool.blocks_needed(s, first, n) for s, first, n in items)
        if need > self.pool.free_blocks:
            raise EngineError(EngineFault.CAPACITY,
                              f"ingest needs {need} free blocks, the pool has {self.pool.free_blocks}")
        rows = int(sum(batch.counts))
        if rows:
            self._ensure_positions(int(batch.positions.max()) + 1)
        if any(first < s.length for s, first, _ in items):
            self.flush()                 # a rewind frees or rewrites rows that may still be waiting
        with self._on_device():
            slots = []
            for state, first, n in items:
                self.pool.extend(state, first, n, self.cache.copy_block)   # copies rows older than a fork
                self.host_tables.update(state, first // self.pool.block_rows)
                if n:
                    slots.append(self.cache.slots(state.blocks, first, n))
            if rows:
                index = np.empty((2, rows), dtype=np.int64)
                index[0] = batch.positions.numpy()
                index[1] = np.concatenate(slots)
                self._pending.append((index, batch.hidden.to(self.device, non_blocking=True).to(self.dtype)))
                self.pending_rows += rows
        if batch.hidden is None or (batch.hidden.device.type != "cpu" and not batch.owned) or \
                not rows * 4 <= self.coalesce_rows or self.pending_rows >= self.coalesce_rows:
            self.flush()                 # device rows the caller owns may change after the call; large ingests go now
        self._stats["ingest_rows"] = rows
        self._stats["ingest_seconds"] = time.perf_counter() - start

    def take_pending(self) -> list[tuple[np.ndarray, torch.Tensor]]:
        """Hand the waiting rows over (``(positions and slots [2, n], hidden [n, W])`` each)
        to whoever stores them next: :meth:`flush`, or a graph replay (:mod:`.graphs`)."""
        pending, self._pending, self.pending_rows = self._pending, [], 0
        return pending

    def flush(self) -> None:
        """Project and store every ingested row still waiting (see the module docstring)."""
        if not self._pending:
            return
        pending = self.take_pending()
        with self._on_device(), torch.inference_mode():
            events = self._events()
            index = pending[0][0] if len(pending) == 1 else np.concatenate([i for i, _ in pending], axis=1)
            hidden = pending[0][1] if len(pending) == 1 else torch.cat([h for _, h in pending])
            index = torch.from_numpy(index).to(self.device, non_blocking=True)
            self.store_rows(index[0], index[1], hidden)
            if events is not None:
                events[1].record(self.stream)
                self._ingest_events = events

    def store_rows(self, positions: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """Project context rows ``hidden [n, W]`` and write their K/V at ``slots`` (graph-capturable)."""
        proj = context_projection(self.weights, self.ops, hidden)
        self.ops.store_context(proj, self.weights.k_norms, self.weights.cos_sin, positions, slots,
                               self.cache.kv, self.config)

    def _events(self) -> tuple[Any, Any] | None:
        if self.stream is None:
            return None
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        return begin, end

    # ---------------------------------------------------------- propose ---

    def host_inputs(self, anchors: torch.Tensor, states: list[BlockTable], rows: int, width: int,
                    out: np.ndarray | None = None) -> torch.Tensor:
        """One int32 buffer ``[anchors (rows) | context lengths (rows) | tables (rows x width)]``;
        rows past ``len(states)`` are padding (anchor 0, no context). Table entries past a
        request's blocks are never read, so a reused ``out`` keeps stale ones."""
        if out is None:
            buf = np.zeros(rows * (2 + width), dtype=np.int32)
        else:
            buf = out
            buf[:2 * rows] = 0
        n = len(states)
        buf[:n] = anchors.numpy()
        buf[rows:rows + n] = [s.length for s in states]
        tables = buf[2 * rows:].reshape(rows, width)
        for i, s in enumerate(states):
            tables[i, :len(s.blocks)] = self.host_tables.get(s)
        return torch.from_numpy(buf)

    @staticmethod
    def device_batch(buf: torch.Tensor, rows: int, width: int, k: int) -> BlockBatch:
        return BlockBatch(buf[:rows], buf[rows:2 * rows], buf[2 * rows:].view(rows, width), k)

    def forward(self, batch: BlockBatch) -> torch.Tensor:
        """Draft logits ``[R, k, draft_V]`` of a device batch (graph-capturable)."""
        return block_logits(self.weights, self.ops, self.cache.kv, batch,
                            self._splits(batch.anchors.shape[0]))

    def step(self, batch: BlockBatch, store: tuple | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph replays: store context rows (``store``: positions, slots, hidden; or
        None), then :meth:`drafts`."""
        if store is not None:
            self.store_rows(*store)
        return self.drafts(batch)

    def drafts(self, batch: BlockBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy draft ids ``[R, k]`` on the device (graph-capturable); an engine with
        per-draft confidence returns ``(ids, confidence [R, k] float32)``."""
        return greedy(self.weights, self.ops, self.forward(batch))

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Proposal:
        start = time.perf_counter()
        r, k = len(batch.states), batch.k
        if r == 0 or k == 0:
            return self._empty(r, k, batch)
        self._ensure_positions(max(s.length for s in batch.states) + k + 1)
        anchors = batch.anchors
        if anchors.dim() != 1 or anchors.is_cuda:
            anchors = anchors.reshape(-1).cpu()
        tokens = None
        with self._on_device():
            if batch.logits == "none" and self.graphs is not None:
                tokens = self.graphs.run(anchors, batch.states, k, batch)   # stores the waiting rows
            if tokens is not None:
                out = Proposal(tokens[0], ready=tokens[1], confidence=tokens[2])
            else:
                self.flush()
                out = self._propose_eager(anchors, batch)
        self._stats["propose_batch"] = r
        self._stats["propose_seconds"] = time.perf_counter() - start
        return out

    def _propose_eager(self, anchors: torch.Tensor, batch: ProposeBatch) -> Proposal:
        r, k = len(batch.states), batch.k
        width = max(1, max(len(s.blocks) for s in batch.states))
        buf = self.host_inputs(anchors, batch.states, r, width).to(self.device, non_blocking=True)
        logits = self.forward(self.device_batch(buf, r, width, k))
        ids = greedy(self.weights, self.ops, logits)
        if batch.logits == "full":
            return Proposal(ids.cpu(), logits=target_logits(self.weights, logits).cpu())
        if batch.logits == "topk":
            values, indices = target_logits(self.weights, logits).topk(batch.topk, dim=-1)
            return Proposal(ids.cpu(), topk_values=values.cpu(), topk_indices=indices.cpu())
        return Proposal(ids.cpu())

    def _empty(self, r: int, k: int, batch: ProposeBatch) -> Proposal:
        out = Proposal(torch.full((r, k), -1, dtype=torch.long))
        if batch.logits == "full":
            out.logits = torch.zeros(r, k, self.config.vocab_size)
        elif batch.logits == "topk":
            out.topk_values = torch.zeros(r, k, batch.topk)
            out.topk_indices = torch.zeros(r, k, batch.topk, dtype=torch.long)
        return out

    # ------------------------------------------------------------ stats ---

    def stats(self) -> dict[str, float]:
        """Last propose/ingest step (seconds, batch size / rows) and pool occupancy, for
        /metrics. On CUDA the ingest time is the device's, once its work has finished."""
        if self._ingest_events is not None and self._ingest_events[1].query():
            begin, end = self._ingest_events
            self._stats["ingest_seconds"] = begin.elapsed_time(end) / 1e3
            self._ingest_events = None
        return {**self._stats, "pool_used_blocks": self.pool.used_blocks,
                "pool_total_blocks": self.pool.num_blocks}
