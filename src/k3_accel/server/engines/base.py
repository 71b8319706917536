"""The contract between the draft server and a drafting engine.

The server owns request bookkeeping (ids, lengths, token history, LRU,
memory budget); an engine owns only its per-request model state (e.g. K/V)
and the drafting math. Engines never see the wire protocol.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class EngineError(Exception):
    """An engine refused an operation; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineCaps:
    kind: str                      # "ngram" | "dflash"
    needs_hidden_states: bool      # context rows must carry aux hidden rows
    context_width: int             # width of one hidden row (0 if none)
    hidden_dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    supports_logits: bool = False  # full [R, K, V] logits
    supports_topk: bool = False
    max_spec_tokens: int = 16
    block_size: int = 16           # reconnect granularity
    vocab_size: int = 0
    mask_token_id: int = -1
    aux_layer_ids: tuple[int, ...] = field(default_factory=tuple)


@dataclass
class Proposal:
    tokens: torch.Tensor                   # [R, K] int64 on CPU, -1 = none
    logits: torch.Tensor | None = None     # [R, K, V] float on CPU (optional)


class DraftEngine(ABC):
    caps: EngineCaps

    @property
    @abstractmethod
    def bytes_per_row(self) -> int:
        """Bytes of engine state one context row costs (memory budgeting)."""

    @abstractmethod
    def new_state(self) -> Any:
        """Empty per-request state."""

    @abstractmethod
    def append(self, state: Any, positions: torch.Tensor, token_ids: torch.Tensor,
               hidden: torch.Tensor | None) -> None:
        """Append context rows. ``positions`` are contiguous and start at the
        state's current length (the server guarantees it)."""

    @abstractmethod
    def truncate(self, state: Any, length: int) -> None:
        """Keep only the first ``length`` rows (rewind)."""

    @abstractmethod
    def fork(self, state: Any, length: int) -> Any:
        """A new, independent state holding a copy of the first ``length`` rows."""

    @abstractmethod
    def propose(self, states: list[Any], histories: list[Sequence[int]],
                anchors: list[int], k: int, want_logits: bool = False) -> Proposal:
        """Draft ``k`` tokens for each request.

        ``histories[i]`` is the request's token ids for positions 0..L-1
        (context) and ``anchors[i]`` the token at position L (just sampled).
        """
