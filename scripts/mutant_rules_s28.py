"""Rule mutants of the twenty-eighth session: the persistent Markov kernel (each program walks its
column blocks with a stride, keeps a running best, reuses its first w1 rows only when one dot holds
the rank, draws noise when any of its rows samples), the fused block inputs, drafts decoding and
confidence head. Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

D = "server/engines/dflash/"
PRECISION = ("tests/test_dflash_precision.py",)
S28_MUTANTS = (
    Mutant("s28-markov-running-best-dropped", "a program's pick is the best over all its column blocks",
           D + "triton_sampling.py", "        best = tl.maximum(best, tl.max(packed, axis=1))",
           "        best = tl.max(packed, axis=1)", PRECISION),
    Mutant("s28-markov-stride-skips-blocks", "the programs together read every column block",
           D + "triton_sampling.py", "    for c in range(tl.program_id(0), n_chunks, n_programs):",
           "    for c in range(tl.program_id(0), n_chunks, n_programs + 1):", PRECISION),
    Mutant("s28-markov-wide-rank-first-rows", "past one dot's rank, each part of the rank reads its own w1 columns",
           D + "triton_sampling.py", "            if k0 == 0:", "            if True:", PRECISION),
    Mutant("s28-markov-hot-rows-unnoised", "a program with any sampling row draws the noise",
           D + "triton_sampling.py", "            if hot:", "            if False:", PRECISION),
    Mutant("s28-drafts-transposed", "the drafts [R, k] are the picks [k, R] transposed", D + "triton_sampling.py",
           "    packed = tl.load(best_ptr + (idx % k) * r + idx // k",
           "    packed = tl.load(best_ptr + (idx // r) * r + idx % r", PRECISION),
    Mutant("s28-block-positions-shifted", "a query block's rows sit at the context length and on",
           D + "ops_triton.py", "    tl.store(pos_ptr + idx, start + o, mask=ok)",
           "    tl.store(pos_ptr + idx, start + o + 1, mask=ok)", PRECISION),
    Mutant("s28-confidence-reads-the-draft", "the confidence kernel reads each step's previous token",
           D + "ops_triton.py", "            prev = tl.load(ids_ptr + row - 1)", "            prev = tl.load(ids_ptr + row)",
           PRECISION),
    Mutant("s28-confidence-first-anchor", "the first step's previous token is its own request's anchor",
           D + "ops_triton.py", "            prev = tl.load(anchor_ptr + row // k)",
           "            prev = tl.load(anchor_ptr + row % k)", PRECISION),
)
