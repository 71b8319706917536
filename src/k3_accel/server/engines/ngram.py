"""Prompt-lookup (n-gram) drafting over each request's own token history.

What vLLM's ``ngram`` method does, served remotely: the longest n-gram
(``max_n`` down to ``min_n``) that ends the history (context + anchor) and
occurred earlier wins; the tokens that followed its *earliest* occurrence are
the draft (vLLM's tie rule). Needs no weights and no hidden states.

Each request keeps an index ``gram -> start of its earliest occurrence`` per
n, updated as rows arrive, so a proposal costs O(max_n), not O(history).
The block pool only accounts for memory here (blocks hold no tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from k3_accel.server.engines.base import DraftEngine, EngineCaps, IngestBatch, Proposal, ProposeBatch
from k3_accel.server.engines.pool import BlockPool, BlockTable

DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass(eq=False)
class NgramState:
    max_n: int
    table: BlockTable = field(default_factory=BlockTable)
    tokens: list[int] = field(default_factory=list)
    first: list[dict] = field(default_factory=list)   # first[n-1][gram] = start of earliest occurrence

    def __post_init__(self) -> None:
        self.first = [{} for _ in range(self.max_n)]

    def extend(self, new: list[int]) -> None:
        toks, first = self.tokens, self.first
        for t in new:
            toks.append(t)
            end = len(toks)
            for n in range(1, min(self.max_n, end) + 1):
                first[n - 1].setdefault(tuple(toks[end - n:]), end - n)

    def rewind(self, length: int) -> None:
        if length == len(self.tokens):
            return
        tokens = self.tokens[:length]
        self.tokens, self.first = [], [{} for _ in range(self.max_n)]
        self.extend(tokens)

    def propose(self, anchor: int, k: int, min_n: int) -> list[int]:
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length), min_n - 1, -1):
            start = self.first[n - 1].get((*toks[length - n + 1:], anchor) if n > 1 else (anchor,))
            if start is not None:
                begin = start + n
                out = toks[begin:begin + k]
                if len(out) < k and begin + len(out) == length:
                    out = out + [anchor]          # the continuation may run into the anchor
                return out[:k]
        return []


class NgramEngine(DraftEngine):
    def __init__(self, *, max_spec_tokens: int = 16, min_n: int = 1, max_n: int = 3,
                 block_size: int = 16, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.caps = EngineCaps(kind="ngram", needs_hidden_states=False, context_width=0,
                               hidden_dtypes=(), max_spec_tokens=max_spec_tokens, block_size=block_size)
        self.pool = BlockPool(max(1, budget_bytes // (block_size * self.bytes_per_row)), block_size)

    @property
    def bytes_per_row(self) -> int:
        return 8 * (1 + self.max_n)  # the token id kept by the server and by the index

    def new_state(self) -> NgramState:
        return NgramState(self.max_n)

    def table(self, state: NgramState) -> BlockTable:
        return state.table

    def length(self, state: NgramState) -> int:
        return state.table.length

    def ingest(self, batch: IngestBatch) -> None:
        tokens = batch.token_ids.tolist()
        at = 0
        for state, start, count in zip(batch.states, batch.starts, batch.counts):
            self.pool.extend(state.table, start, count)
            state.rewind(start)
            state.extend(tokens[at:at + count])
            at += count

    def fork(self, state: NgramState, length: int) -> NgramState:
        new = NgramState(self.max_n, self.pool.fork(state.table, length))
        new.extend(state.tokens[:length])
        return new

    def release(self, state: NgramState) -> None:
        self.pool.release(state.table)

    def propose(self, batch: ProposeBatch) -> Proposal:
        k, min_n = batch.k, self.min_n
        out = np.full((len(batch.states), k), -1, dtype=np.int64)
        for i, (state, anchor) in enumerate(zip(batch.states, batch.anchors.tolist())):
            found = state.propose(anchor, k, min_n)
            if found:
                out[i, :len(found)] = found
        return Proposal(tokens=torch.from_numpy(out))
