"""int32 mirrors of block tables, kept up to date as the engine edits them.

Building a propose's block tables from Python lists costs ~1 µs per 30 block
ids on the host, every step; the engine instead updates a NumPy mirror of each
table where it changes (an ingest touches the table from its first rewritten
block on, a fork builds a new one), and a propose copies the mirrors. A mirror
whose length or end blocks disagree with its table (a table edited elsewhere)
is rebuilt from the list; the check compares plain ints kept at the last copy (no NumPy
scalar on a propose's look-up, nor on an ingest's partial copy). The mirror lives on the table
(``BlockTable.mirror``: it goes with the table, and a look-up is an attribute read).
"""
from __future__ import annotations

import numpy as np

from ..pool import BlockTable


class _Mirror:
    """A table's int32 mirror and its length and end blocks as of the last copy (plain ints: the
    check of a propose's look-up costs no NumPy scalar)."""
    __slots__ = ("arr", "n", "first", "last")

    def __init__(self, arr: np.ndarray) -> None:
        self.arr, self.n, self.first, self.last = arr, 0, None, None


class HostTables:
    def update(self, table: BlockTable, first: int = 0) -> None:
        """Copy ``table.blocks[first:]`` into the mirror (entries before ``first`` unchanged; never
        past what the mirror holds: those are copied too)."""
        blocks = table.blocks
        n = len(blocks)
        mirror = table.mirror
        if mirror is None:
            mirror = table.mirror = _Mirror(np.empty(max(16, n), dtype=np.int32))
        if first > mirror.n:
            first = mirror.n
        arr = mirror.arr
        if arr.shape[0] < n:
            grown = np.empty(max(n, 2 * arr.shape[0]), dtype=np.int32)
            grown[:first] = arr[:first]
            mirror.arr = arr = grown
        # the ends the mirror holds now: a head it kept may disagree with a table edited elsewhere
        if n > first:
            arr[first:n] = blocks[first:n]
            mirror.last = blocks[-1]
        else:
            mirror.last = int(arr[n - 1]) if n else None
        if first == 0:
            mirror.first = blocks[0] if n else None
        mirror.n = n

    def get(self, table: BlockTable) -> np.ndarray:
        """The table's block ids as int32 (a view: copy before the table changes)."""
        blocks = table.blocks
        n = len(blocks)
        if not n:
            return np.empty(0, dtype=np.int32)
        mirror = table.mirror
        if mirror is None or mirror.n != n or mirror.first != blocks[0] or mirror.last != blocks[-1]:
            self.update(table, 0)
            mirror = table.mirror
        return mirror.arr[:n]
