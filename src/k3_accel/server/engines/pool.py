"""A fixed pool of context blocks and the per-request block tables over it.

The pool is the draft server's only memory budget: an engine sizes it once
at start (blocks of ``block_rows`` context rows) and every request's context
lives in blocks it holds through a :class:`BlockTable`. Growing, rewinding,
forking and releasing a request only edit block tables; forks share full
blocks (reference counts) and copy at most a partial last block. A table
never writes into a block it shares: :meth:`BlockPool.writable` swaps such
a block for a private copy first (copy on write).

Every block is counted against the owner of the table that allocated it
(a table's ``owner``: the server's session slot; forks keep their source's
owner), so :meth:`BlockPool.held` says how many distinct blocks an owner
holds in O(1): the fair-share rule (:mod:`k3_accel.server.share`) reads it.

No tensors here: an engine that stores rows in blocks passes a
``copy_block(src, dst, rows)`` callback; one that stores nothing in them
(ngram) uses the pool for accounting only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

CopyBlock = Callable[[int, int, int], None]   # (src block, dst block, rows to copy)


class PoolExhausted(Exception):
    """Not enough free blocks; nothing was changed."""

    def __init__(self, need: int, free: int):
        super().__init__(f"{need} block(s) needed, {free} free")
        self.need, self.free = need, free


@dataclass(eq=False)
class BlockTable:
    """One request's context: rows ``0..length-1`` live in ``blocks`` in order."""
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    owner: int = 0               # whom its blocks are counted against (0: nobody in particular)
    mirror: Any = field(default=None, repr=False)   # an engine's copy of ``blocks`` (opaque here)


class BlockPool:
    def __init__(self, num_blocks: int, block_rows: int):
        if num_blocks < 1 or block_rows < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 row, got {num_blocks} x {block_rows}")
        self.num_blocks, self.block_rows = num_blocks, block_rows
        self._refs = np.zeros(num_blocks, dtype=np.int32)
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)   # a stack: low ids first
        self._top = num_blocks                                           # free ids: _free[:_top]
        self._owner = np.zeros(num_blocks, dtype=np.int64)               # who allocated each block
        self._held: dict[int, int] = {}                                  # owner -> blocks it holds

    # ------------------------------------------------------------- counts
    @property
    def free_blocks(self) -> int:
        return self._top

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self._top

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_rows)

    def held(self, owner: int) -> int:
        """Distinct blocks in use that ``owner``'s tables allocated."""
        return self._held.get(owner, 0)

    def refcount(self, block: int) -> int:
        return int(self._refs[block])

    def blocks_needed(self, table: BlockTable, start: int, count: int) -> int:
        """Free blocks the pool must have for a table to hold rows ``start .. start+count-1``
        after a rewind to ``start`` (blocks the rewind itself frees are counted as free)."""
        if start == table.length and 0 < count <= len(table.blocks) * self.block_rows - start \
                and self._refs[table.blocks[-1]] == 1:
            return 0                               # the common append into a private last block
        if not 0 <= start <= table.length:
            raise ValueError(f"rows start at {start}, the table holds {table.length}")
        if count <= 0:
            return 0
        keep = self.blocks_for(start)              # blocks still holding rows below ``start``
        need = self.blocks_for(start + count) - keep
        if start % self.block_rows and self._refs[table.blocks[keep - 1]] > 1:
            need += 1                              # the partial block is shared: it gets copied
        freed = int((self._refs[table.blocks[keep:]] == 1).sum()) if len(table.blocks) > keep else 0
        return max(0, need - freed)

    # --------------------------------------------------------- primitives
    def allocate(self, n: int, owner: int = 0) -> list[int]:
        if n > self._top:
            raise PoolExhausted(n, self._top)
        if n <= 0:
            return []
        out = self._free[self._top - n:self._top][::-1]
        self._top -= n
        self._refs[out] = 1
        self._owner[out] = owner
        self._held[owner] = self._held.get(owner, 0) + n
        return out.tolist()

    def release_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            left = self._refs[b] - 1
            if left < 0:
                raise AssertionError(f"block {b} released more often than held")
            self._refs[b] = left
            if left == 0:
                self._free[self._top] = b
                self._top += 1
                self._held[int(self._owner[b])] -= 1

    # ------------------------------------------------------ table editing
    def truncate(self, table: BlockTable, length: int) -> None:
        """Keep rows ``0..length-1``; blocks past them go back to the pool."""
        if not 0 <= length <= table.length:
            raise ValueError(f"cannot truncate {table.length} rows to {length}")
        keep = self.blocks_for(length)
        self.release_blocks(table.blocks[keep:])
        del table.blocks[keep:]
        table.length = length

    def extend(self, table: BlockTable, start: int, count: int, copy_block: CopyBlock | None = None) -> None:
        """Rewind to ``start`` and make room for ``count`` more rows. Raises
        :class:`PoolExhausted` (nothing changed) when the pool is short."""
        r = self.block_rows
        if start == table.length and 0 < count <= len(table.blocks) * r - start \
                and self._refs[table.blocks[-1]] == 1:
            table.length += count                  # the common append: room in a private last block
            return
        need = self.blocks_needed(table, start, count)
        if need > self._top:
            raise PoolExhausted(need, self._top)
        self.truncate(table, start)
        if count <= 0:
            return
        if start % r:
            self._own_last(table, copy_block)
        end = start + count
        table.blocks.extend(self.allocate(self.blocks_for(end) - len(table.blocks), table.owner))
        table.length = end

    def _own_last(self, table: BlockTable, copy_block: CopyBlock | None) -> None:
        """Copy a shared partial last block before rows are written into it."""
        last = table.blocks[-1]
        if self._refs[last] == 1:
            return
        (fresh,) = self.allocate(1, table.owner)
        if copy_block is not None:
            copy_block(last, fresh, table.length % self.block_rows)
        self.release_blocks([last])
        table.blocks[-1] = fresh

    def fork(self, table: BlockTable, length: int, copy_block: CopyBlock | None = None) -> BlockTable:
        """A new table over rows ``0..length-1`` of ``table``: full blocks shared, a
        partial last block copied. Raises :class:`PoolExhausted` when it needs a block."""
        if not 0 <= length <= table.length:
            raise ValueError(f"cannot fork {length} of {table.length} rows")
        full, partial = divmod(length, self.block_rows)
        shared = table.blocks[:full]
        copied = self.allocate(1, table.owner) if partial else []
        for b in shared:
            self._refs[b] += 1
        if partial and copy_block is not None:
            copy_block(table.blocks[full], copied[0], partial)
        return BlockTable(shared + copied, length, table.owner)

    def fork_needed(self, length: int) -> int:
        return 1 if length % self.block_rows else 0

    def release(self, table: BlockTable) -> None:
        self.release_blocks(table.blocks)
        table.blocks, table.length = [], 0
