"""int32 mirrors of block tables, kept up to date as the engine edits them.

Building a propose's block tables from Python lists costs ~1 µs per 30 block
ids on the host, every step; the engine instead updates a NumPy mirror of each
table where it changes (an ingest touches the table from its first rewritten
block on, a fork builds a new one), and a propose copies the mirrors. A mirror
whose length or end blocks disagree with its table (a table edited elsewhere)
is rebuilt from the list.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..pool import BlockTable


class HostTables:
    def __init__(self) -> None:
        self._arrays: weakref.WeakKeyDictionary[BlockTable, np.ndarray] = weakref.WeakKeyDictionary()

    def update(self, table: BlockTable, first: int = 0) -> None:
        """Copy ``table.blocks[first:]`` into the mirror (entries before ``first`` unchanged)."""
        n = len(table.blocks)
        arr = self._arrays.get(table)
        if arr is None or arr.shape[0] < n:
            grown = np.empty(max(16, n, 0 if arr is None else 2 * arr.shape[0]), dtype=np.int32)
            if arr is None:
                first = 0
            else:
                grown[:first] = arr[:first]
            arr = grown
            self._arrays[table] = arr
        if n > first:
            arr[first:n] = table.blocks[first:n]

    def get(self, table: BlockTable) -> np.ndarray:
        """The table's block ids as int32 (a view: copy before the table changes)."""
        blocks, n = table.blocks, len(table.blocks)
        arr = self._arrays.get(table)
        if n and (arr is None or arr.shape[0] < n or arr[0] != blocks[0] or arr[n - 1] != blocks[-1]):
            self.update(table, 0)
            arr = self._arrays[table]
        return arr[:n] if n else np.empty(0, dtype=np.int32)
