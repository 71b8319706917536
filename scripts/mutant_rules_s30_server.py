"""Rule mutants of the thirtieth session for the server's decode path as it was made leaner: the
admission's one-look-up decision for an active, clean request, the n-gram engine's kept suffix key
and its packed-key limit, and apply's per-request token histories. Each names the tests that must
notice."""
from __future__ import annotations

from mutant import Mutant

ROWS = "server/rows.py"
NG = "server/engines/ngram.py"
ADMIT = ("tests/test_server.py", "tests/test_server_rules.py", "tests/test_store.py", "tests/test_server_capacity.py",
         "tests/test_server_hostile.py")
NGRAM = ("tests/test_ngram.py",)
FAST = "        if state is not None and not flag and not precise and start <= state.length:"
S30_SERVER_MUTANTS = (
    Mutant("s30-admit-fast-gap", "rows past an active request's context are refused", ROWS,
           FAST, "        if state is not None and not flag and not precise:", ADMIT),
    Mutant("s30-admit-fast-flag", "an active request's bad token ids or non-finite rows fail it", ROWS,
           FAST, "        if state is not None and not precise and start <= state.length:", ADMIT),
    Mutant("s30-admit-fast-anchor", "an active request's anchor outside the vocabulary fails it", ROWS,
           "    if bad_anchors is not None:\n        flagged |= bad_anchors\n", "", ADMIT),
    Mutant("s30-admit-fast-precise", "a tight pool is counted request by request, and room made", ROWS,
           FAST, "        if state is not None and not flag and start <= state.length:", ADMIT),
    Mutant("s30-ngram-packed-wide", "grams of more than three ids are not packed into an int64", NG,
           "        self.packed = self.max_n * _BITS < 64", "        self.packed = True", NGRAM),
    Mutant("s30-ngram-push-key", "a decode row's n-gram keys hold its n - 1 previous ids", NG,
           "            first[n - 1].setdefault(((suffix & _MASKS[n - 1]) << _BITS) | token, pos - n + 1)",
           "            first[n - 1].setdefault(((suffix & _MASKS[n - 2]) << _BITS) | token, pos - n + 1)", NGRAM),
    Mutant("s30-ngram-rewind-suffix", "a rewind's history is what the next decode row's keys extend", NG,
           "            self._index(0, length)\n            self._resuffix()\n", "            self._index(0, length)\n",
           NGRAM),
    Mutant("s30-ngram-push-large-id", "an id past the packed range switches the request to exact keys", NG,
           "            if count == 1 and start == state.length and state.packed and ids is not None \\\n"
           "                    and 0 <= ids[at] < _PACKABLE:",
           "            if count == 1 and start == state.length and state.packed and ids is not None:", NGRAM),
    Mutant("s30-histories-first-only", "an engine reading histories gets each request's own", "server/service.py",
           "        return self._states[i].history\n", "        return self._states[0].history\n",
           ("tests/test_server_rules.py", "tests/test_server.py")),
    Mutant("s30-apply-history-rows", "each request's stored history holds its own rows", ROWS,
           "    for state, start, a, b in zip(states, starts_l, offsets_l, offsets_l[1:]):",
           "    for state, start, a, b in zip(states, starts_l, offsets_l[1:], offsets_l[2:] + [total]):",
           ("tests/test_server.py", "tests/test_server_rules.py", "tests/test_server_dflash.py", "tests/test_store.py")),
)
