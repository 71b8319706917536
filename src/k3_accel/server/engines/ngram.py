"""Prompt-lookup (n-gram) drafting over each request's own token history.

What vLLM's ``ngram`` method does, served remotely: the longest n-gram
(``max_n`` down to ``min_n``) that ends the history (context + anchor) and
occurred earlier wins; the tokens that followed its *earliest* occurrence are
the draft (vLLM's tie rule). Needs no weights and no hidden states.

Each request keeps, per n, an index ``gram -> start of its earliest
occurrence``, built with numpy as rows arrive (up to 3 token ids below
2**21 pack into one int64 key; a request that ever holds a larger id, or an
engine with ``max_n > 3``, keys grams by tuples instead), so a proposal costs
O(max_n), not O(history). A decode step's row is indexed from the packed key
of the request's last ``max_n - 1`` tokens, kept as it goes (``suffix``).
The block pool only accounts for memory here (blocks hold no tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from k3_accel.server.engines.base import DraftEngine, EngineCaps, IngestBatch, Proposal, ProposeBatch
from k3_accel.server.engines.pool import BlockPool, BlockTable

DEFAULT_BUDGET_BYTES = 1 << 30
_BITS = 21                       # bits per token id in a packed gram key
_PACKABLE = 1 << _BITS
_SMALL = 64                      # appends up to this many rows are indexed in plain Python
_MASKS = tuple((1 << (_BITS * j)) - 1 for j in range(8))   # _MASKS[j]: the j newest tokens of a packed key


def _packed(tokens: np.ndarray, n: int) -> np.ndarray:
    """int64 key of every n-gram of ``tokens`` (ids < 2**21), in order."""
    m = len(tokens) - n + 1
    key = tokens[:m].copy()
    for j in range(1, n):
        key = (key << _BITS) | tokens[j:j + m]
    return key


@dataclass(eq=False)
class NgramState:
    max_n: int
    table: BlockTable = field(default_factory=BlockTable)
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    length: int = 0
    first: list[dict] = field(default_factory=list)   # first[n-1][key] = start of earliest occurrence
    packed: bool = True
    suffix: int = 0              # packed key of the last max_n - 1 tokens (when packed): a decode step's keys

    def __post_init__(self) -> None:
        self.first = [{} for _ in range(self.max_n)]
        self.packed = self.max_n * _BITS < 64          # a gram's key must fit an int64 (max_n <= 3)

    @property
    def history(self) -> np.ndarray:
        return self.tokens[:self.length]

    def extend(self, new: np.ndarray) -> None:
        start, end = self.length, self.length + len(new)
        if end > len(self.tokens):
            grown = np.empty(max(end, 2 * len(self.tokens), 64), dtype=np.int64)
            grown[:start] = self.tokens[:start]
            self.tokens = grown
        self.tokens[start:end] = new
        self.length = end
        if start == end:
            return
        if end - start <= _SMALL:
            values = new.tolist()
            large = max(values) >= _PACKABLE or min(values) < 0
        else:
            large = int(new.max()) >= _PACKABLE or int(new.min()) < 0
        if self.packed and large:
            self.packed = False
            self._index(0, end)                      # re-key everything as tuples
        else:
            self._index(start, end)
        self._resuffix()

    def push(self, token: int) -> None:
        """Append one token (a decode step's row; the caller checked ``0 <= token < 2**21`` and that
        the keys are packed): what :meth:`extend` does for it, from the kept suffix."""
        pos = self.length
        if pos == len(self.tokens):
            grown = np.empty(max(2 * pos, 64), dtype=np.int64)
            grown[:pos] = self.tokens
            self.tokens = grown
        self.tokens[pos] = token
        self.length = pos + 1
        first, suffix = self.first, self.suffix
        first[0].setdefault(token, pos)
        for n in range(2, min(self.max_n, pos + 1) + 1):
            first[n - 1].setdefault(((suffix & _MASKS[n - 1]) << _BITS) | token, pos - n + 1)
        self.suffix = ((suffix << _BITS) | token) & _MASKS[self.max_n - 1]

    def _resuffix(self) -> None:
        key = 0
        if self.packed:
            for t in self.tokens[max(self.length - self.max_n + 1, 0):self.length].tolist():
                key = (key << _BITS) | t
        self.suffix = key

    def _index(self, start: int, end: int) -> None:
        """Add the grams that end at positions start..end-1."""
        if start == 0:
            self.first = [{} for _ in range(self.max_n)]
        if end - start <= _SMALL:
            self._index_small(start, end)
            return
        for n in range(1, self.max_n + 1):
            lo = max(start - n + 1, 0)
            span = self.tokens[lo:end]
            if len(span) < n:
                continue
            if self.packed:
                keys = _packed(span, n)
                uniq, idx = np.unique(keys, return_index=True)
                new = dict(zip(uniq.tolist(), (idx + lo).tolist()))
            else:
                seq = span.tolist()
                new = {}
                for i in range(len(seq) - n + 1):
                    new.setdefault(tuple(seq[i:i + n]), lo + i)
            old = self.first[n - 1]
            if len(old) < len(new):                  # earlier occurrences (old) win
                new.update(old)
                self.first[n - 1] = new
            else:
                for key, at in new.items():
                    old.setdefault(key, at)

    def _index_small(self, start: int, end: int) -> None:
        """The same as the numpy path, a token at a time (cheaper for a few rows)."""
        max_n, first = self.max_n, self.first
        lo = max(start - max_n + 1, 0)
        hist = self.tokens[lo:end].tolist()
        for pos in range(start, end):
            j = pos - lo
            if self.packed:
                key = shift = 0
                for n in range(1, min(max_n, pos + 1) + 1):
                    key |= hist[j - n + 1] << shift      # the newest token sits in the lowest bits
                    shift += _BITS
                    first[n - 1].setdefault(key, pos - n + 1)
            else:
                for n in range(1, min(max_n, pos + 1) + 1):
                    first[n - 1].setdefault(tuple(hist[j - n + 1:j + 1]), pos - n + 1)

    def rewind(self, length: int) -> None:
        if length < self.length:
            self.length = length
            self._index(0, length)
            self._resuffix()

    def propose(self, anchor: int, k: int, min_n: int) -> list[int] | None:
        length = self.length
        top = min(self.max_n, length)
        if top < min_n:
            return None
        if self.packed:
            if not 0 <= anchor < _PACKABLE:
                return None                          # no such gram can be in a packed index
            suffix, first = self.suffix, self.first  # the newest token sits in the lowest bits
            for n in range(top, min_n - 1, -1):
                start = first[n - 1].get(((suffix & _MASKS[n - 1]) << _BITS) | anchor)
                if start is not None:
                    return self._continuation(start + n, k, anchor)
            return None
        tail = self.tokens[length - top + 1:length].tolist() if top > 1 else []
        for n in range(top, min_n - 1, -1):
            start = self.first[n - 1].get((*tail[len(tail) - n + 1:], anchor))
            if start is not None:
                return self._continuation(start + n, k, anchor)
        return None

    def _continuation(self, begin: int, k: int, anchor: int) -> list[int]:
        """Up to ``k`` tokens from ``begin``; the continuation may run into the anchor."""
        out = self.tokens[begin:min(begin + k, self.length)].tolist()
        if len(out) < k and begin + len(out) == self.length:
            out.append(anchor)
        return out


class NgramEngine(DraftEngine):
    def __init__(self, *, max_spec_tokens: int = 16, min_n: int = 1, max_n: int = 3,
                 block_size: int = 16, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.caps = EngineCaps(kind="ngram", needs_hidden_states=False, context_width=0,
                               hidden_dtypes=(), max_spec_tokens=max_spec_tokens, block_size=block_size,
                               draft={"prompt_lookup_min": min_n, "prompt_lookup_max": max_n})   # vLLM's names
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
        tokens = batch.token_ids.numpy()
        ids = tokens.tolist() if len(tokens) <= 4 * len(batch.states) else None   # decode steps: a row or few each
        at = 0
        for state, start, count in zip(batch.states, batch.starts, batch.counts):
            self.pool.extend(state.table, start, count)
            if count == 1 and start == state.length and state.packed and ids is not None \
                    and 0 <= ids[at] < _PACKABLE:
                state.push(ids[at])
            else:
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
        rows, none = [], [-1] * k
        for state, anchor in zip(batch.states, batch.anchors.tolist()):
            found = state.propose(anchor, k, min_n)
            rows.append(found + none[len(found):] if found else none)
        return Proposal(tokens=torch.from_numpy(np.array(rows, dtype=np.int64).reshape(len(rows), k)))
