"""The DFlash engine's int32 mirrors of block tables (server/engines/dflash/host_tables.py): after
any sequence of edits the mirror holds the table, also when it had to grow past its first 16
blocks while a request's context got long (the first blocks must survive the growth)."""
from __future__ import annotations

import numpy as np
import pytest

from k3_accel.server.engines.dflash.host_tables import HostTables
from k3_accel.server.engines.pool import BlockTable


@pytest.mark.parametrize("step", [1, 3, 7, 17])
def test_a_growing_table_keeps_its_first_blocks(step):
    rng = np.random.default_rng(step)
    tables = HostTables()
    table = BlockTable()
    while len(table.blocks) < 70:                     # grows past 16, 32 and 64 entries
        first = len(table.blocks)
        table.blocks.extend(int(b) for b in rng.integers(0, 10_000, size=step))
        tables.update(table, first)                   # only the new blocks are copied
        n = len(table.blocks)
        assert table.mirror.arr[:n].tolist() == table.blocks     # the mirror itself, before get()
        assert tables.get(table).tolist() == table.blocks


def test_a_rewrite_from_the_middle_keeps_the_head():
    tables = HostTables()
    table = BlockTable(blocks=list(range(100, 120)))
    tables.update(table)
    table.blocks[12:] = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
    tables.update(table, 12)                          # a rewind rewrote from block 12 on, and it grew
    assert table.mirror.arr[:len(table.blocks)].tolist() == table.blocks
    assert tables.get(table).tolist() == table.blocks


def test_a_table_edited_elsewhere_is_read_as_it_is_now():
    """A look-up returns the table as it is, whatever was edited without telling the mirror: a head
    replaced before a partial update, a tail replaced, a cut, a regrowth whose new last block equals
    a stale entry the mirror still holds past the cut, a table of the same ends but a new length."""
    tables = HostTables()
    table = BlockTable(blocks=list(range(1, 11)))
    tables.update(table)
    table.blocks[0] = 500                              # the head, edited elsewhere ...
    table.blocks.append(11)
    tables.update(table, 10)                           # ... then only the new block is copied
    assert tables.get(table).tolist() == table.blocks
    table.blocks[-1] = 700                             # the tail, edited elsewhere
    assert tables.get(table).tolist() == table.blocks
    del table.blocks[5:]                               # a cut, told
    tables.update(table, 5)
    assert tables.get(table).tolist() == table.blocks
    table.blocks.extend([60, 70, 80, 90, 10])          # regrown elsewhere; 10 is also the stale entry at [9]
    assert tables.get(table).tolist() == [500, 2, 3, 4, 5, 60, 70, 80, 90, 10]
    del table.blocks[1:-1]                             # only the ends kept: the same ends, a new length
    assert tables.get(table).tolist() == [500, 10]
    table.blocks[1:1] = [2, 3]
    del table.blocks[-1]                               # a cut nobody told it about
    assert tables.get(table).tolist() == [500, 2, 3]
    table.blocks.clear()
    assert tables.get(table).tolist() == []


def test_a_partial_copy_never_trusts_entries_the_mirror_does_not_hold():
    """``update(table, first)`` says the blocks before ``first`` are unchanged; entries past the
    mirror's own length were never copied (here: stale ones left by a cut), so they are copied too."""
    tables = HostTables()
    table = BlockTable(blocks=[1, 2, 3, 4, 5, 6])
    tables.update(table)
    del table.blocks[4:]                               # a cut, told: the mirror still holds 5, 6 past it
    tables.update(table, 4)
    table.blocks.extend([50, 51, 52])                  # grown, but told only about the last block
    tables.update(table, 6)
    assert table.mirror.arr[:7].tolist() == [1, 2, 3, 4, 50, 51, 52]
    assert tables.get(table).tolist() == [1, 2, 3, 4, 50, 51, 52]
