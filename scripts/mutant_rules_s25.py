"""Rule mutants of the block-table mirrors' look-up (twenty-fifth session): a look-up compares the
table's length and end blocks with plain ints kept at the mirror's last copy, which are the ends the
mirror holds (not the table's, after a partial copy). Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

S25_MUTANTS = (
    Mutant("s25-mirror-length-unchecked", "a mirror whose table changed length since its last copy is rebuilt",
           "server/engines/dflash/host_tables.py", "if mirror is None or mirror.n != n or ",
           "if mirror is None or ", ("tests/test_host_tables.py",)),
    Mutant("s25-mirror-head-from-table", "after a partial copy the kept head is the mirror's own, not the table's",
           "server/engines/dflash/host_tables.py", "        if first == 0:\n            mirror.first = ",
           "        if True:\n            mirror.first = ", ("tests/test_host_tables.py",)),
    Mutant("s25-mirror-copies-past-its-length", "a partial copy starts no later than what the mirror holds",
           "server/engines/dflash/host_tables.py", "        if first > mirror.n:\n            first = mirror.n\n", "",
           ("tests/test_host_tables.py",)),
)
