"""The contract between the draft server and a drafting engine.

The server owns request bookkeeping (ids, namespaces, token history, LRU,
admission against the pool) and validates every input at its boundary; an
engine owns its per-request model state (a :class:`~.pool.BlockTable` over
its :class:`~.pool.BlockPool`, e.g. context K/V) and the drafting math, and
trusts its inputs. Engines never see the wire protocol: they raise
:class:`EngineError` with an :class:`EngineFault`, which the server maps to
a wire code.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Sequence

import torch

from .pool import BlockPool


class EngineFault(str, Enum):
    CAPACITY = "capacity"        # the pool cannot hold what was asked
    BAD_INPUT = "bad_input"      # an input the server should have refused
    UNSUPPORTED = "unsupported"  # e.g. logits from an engine that has none


class EngineError(Exception):
    def __init__(self, fault: EngineFault, message: str):
        super().__init__(message)
        self.fault = EngineFault(fault)


@dataclass(frozen=True)
class EngineCaps:
    kind: str                      # "ngram" | "dflash" | "dspark"
    needs_hidden_states: bool      # context rows must carry aux hidden rows
    context_width: int             # width of one hidden row (0 if none)
    hidden_dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    supports_logits: bool = False  # full [R, K, V] logits
    supports_topk: bool = False
    max_spec_tokens: int = 16
    block_size: int = 16           # pool block = reconnect granularity, in rows
    vocab_size: int = 0            # ids a draft can hold: 0 <= id < vocab_size (0: any)
    hidden_size: int = 0           # target hidden size the aux rows come from (0 if none)
    mask_token_id: int = -1
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)   # target layers, ascending
    draft: dict[str, Any] = field(default_factory=dict)   # what the target's draft config must match
    confidence: bool = False       # replies carry per-draft confidence
    sampling: bool = False         # drafts sampled with each request's temperature and seed


@dataclass
class IngestBatch:
    """Context rows of several requests, in one pass.

    Item ``i`` (``states[i]``, ``starts[i]``, ``counts[i]``) owns the next
    ``counts[i]`` rows of ``positions`` / ``token_ids`` / ``hidden``; its state
    is first rewound to ``starts[i]`` (``<=`` its length). The server
    guarantees: positions are ``start .. start+count-1``, ``hidden`` (when the
    engine needs it) is finite and ``[N, context_width]``, a state appears at
    most once, and the pool has room (:meth:`DraftEngine.blocks_needed`).
    """
    states: list[Any]
    starts: list[int]
    counts: list[int]
    positions: torch.Tensor            # [N] int64, CPU
    token_ids: torch.Tensor            # [N] int64, CPU
    hidden: torch.Tensor | None = None # [N, W] (bf16/fp16/fp32), CPU; may view a read-only frame
    owned: bool = False                # ``hidden`` is on a device and the server's own copy (rows read
                                       # over the device plane): the engine may keep it past the call


@dataclass
class ProposeBatch:
    """Draft ``k`` tokens for each request: request ``i``'s block is
    ``[anchors[i], mask * k]`` right after its context. ``histories[i]`` holds
    its context token ids (positions ``0..length-1``). ``logits``: "none",
    "full" ([R, k, V]) or "topk" (``topk`` largest per draft position, selected
    on the engine's device). ``temperature`` / ``seeds`` (engines with ``caps.sampling``):
    each request's sampling temperature (0: greedy) and seed; None: every request greedy."""
    states: list[Any]
    histories: list[Sequence[int]]
    anchors: torch.Tensor              # [R] int64, CPU, each 0 <= a < vocab_size
    k: int
    logits: str = "none"
    topk: int = 0
    temperature: torch.Tensor | None = None   # [R] float32, CPU, finite, >= 0
    seeds: torch.Tensor | None = None         # [R] int64, CPU

    @property
    def sampled(self) -> bool:
        """Whether any request samples (host data: no device read)."""
        return self.temperature is not None and bool((self.temperature != 0).any())


@dataclass
class Proposal:
    """What a propose returns. With ``ready`` (a CUDA event), the device may still be
    writing ``tokens``: read them only after :meth:`wait` (or once :meth:`done`)."""
    tokens: torch.Tensor                        # [R, k] int64 on CPU, -1 = no draft
    logits: torch.Tensor | None = None          # [R, k, V] on CPU ("full")
    topk_values: torch.Tensor | None = None     # [R, k, topk] on CPU ("topk")
    topk_indices: torch.Tensor | None = None    # [R, k, topk] int64 on CPU
    ready: Any = None
    confidence: torch.Tensor | None = None      # [R, k] float32 on CPU: P(draft accepted) (DSpark)

    def done(self) -> bool:
        return self.ready is None or bool(self.ready.query())

    def wait(self) -> "Proposal":
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self


class DraftEngine(ABC):
    caps: EngineCaps
    pool: BlockPool

    @property
    @abstractmethod
    def bytes_per_row(self) -> int:
        """Bytes of pool memory one context row costs."""

    @abstractmethod
    def new_state(self) -> Any:
        """An empty per-request state holding no blocks."""

    @abstractmethod
    def length(self, state: Any) -> int:
        """Context rows the state holds."""

    def blocks_needed(self, state: Any, start: int, count: int) -> int:
        """Free pool blocks an ingest of ``count`` rows at ``start`` needs."""
        return self.pool.blocks_needed(self.table(state), start, count)

    @abstractmethod
    def table(self, state: Any) -> Any:
        """The state's :class:`~.pool.BlockTable`."""

    @abstractmethod
    def ingest(self, batch: IngestBatch) -> None:
        """Rewind and append every item's rows (see :class:`IngestBatch`)."""

    @abstractmethod
    def fork(self, state: Any, length: int) -> Any:
        """A new state over the first ``length`` rows (shares full blocks, copies a
        partial last one: ``pool.fork_needed(length)`` free blocks)."""

    @abstractmethod
    def release(self, state: Any) -> None:
        """Return the state's blocks to the pool; the state is empty afterwards."""

    @abstractmethod
    def propose(self, batch: ProposeBatch) -> Proposal:
        """Greedy drafts (and logits/top-k when asked) for every request of the batch."""
