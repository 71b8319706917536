"""Rule mutants of the one-launch Markov step (twenty-sixth session): each step folds its pick into a
packed int64 per row by atomic max and the next step reads its previous token (mapped to a target
id) from there; odd steps walk the column blocks backwards; -0.0 ties +0.0; the confidence head
reads each step's previous token. Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

D = "server/engines/dflash/"
S26_MUTANTS = (
    Mutant("s26-markov-prev-unmapped", "a step's previous token is the last draft mapped to a target id",
           D + "triton_sampling.py", "        if HAS_D2T:\n            prev +=", "        if False:\n            prev +=",
           ("tests/test_dflash_precision.py",)),
    Mutant("s26-markov-drafts-unmapped", "the Markov head returns target ids", D + "triton_sampling.py",
           "        col += tl.load(d2t_ptr + col", "        col += 0 * tl.load(d2t_ptr + col", ("tests/test_dflash_precision.py",)),
    Mutant("s26-markov-walk-back-skips-a-block", "a step walking backwards still reads every column block",
           D + "triton_sampling.py", "chunk = c + flip * (n_chunks - 1 - 2 * c)",
           "chunk = c + flip * (n_chunks - 2 * c)", ("tests/test_dflash_precision.py",)),
    Mutant("s26-markov-negative-zero", "-0.0 ties +0.0 (the first column wins, as torch.argmax picks)",
           D + "triton_sampling.py", "    x = tl.where(x == 0.0, 0.0, x)", "    x = x",
           ("tests/test_dflash_precision.py",)),
    Mutant("s26-confidence-reads-the-draft", "the confidence head reads each step's previous token, not its draft",
           D + "ops_torch.py", "        prevs = torch.cat([anchors.long()[:, None], ids[:, :-1]], 1)", "        prevs = ids",
           ("tests/test_dspark_vllm_module.py",), ".venv-vllm033"),
)
