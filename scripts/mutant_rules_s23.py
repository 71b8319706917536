"""Rule mutants of the V2 step thread's yield to the draft thread (``draft_priority``, twenty-third
session): the step thread waits for the step before its own, never for its own; not at all when the
setting is off or the host waits on the fence anyway; never past the GPU deadline; and the fence
that a host thread waits on wakes it when signalled. Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

S23_MUTANTS = (
    Mutant("s23-yield-waits-for-its-own-step", "the step thread waits for the step before its own, not its own",
           "vllm/spec_decode/pipeline.py", "        self.fence.wait(seq - 1, ", "        self.fence.wait(seq, ",
           ("tests/test_draft_priority.py",)),
    Mutant("s23-yield-never", "with draft_priority on, the step thread waits for the step before's drafts",
           "vllm/spec_decode/pipeline.py", "        if not self.priority or seq <= 1 or",
           "        if True or not self.priority or seq <= 1 or",
           ("tests/test_draft_priority.py",)),
    Mutant("s23-yield-ignores-the-switch", "draft_priority off, or a fence the host waits on, never waits",
           "vllm/spec_decode/pipeline.py", "        self.priority = priority and fence.on_device",
           "        self.priority = True",
           ("tests/test_draft_priority.py",)),
    Mutant("s23-yield-unbounded", "the yield never lasts past the GPU deadline",
           "vllm/spec_decode/pipeline.py",
           "        self.fence.wait(seq - 1, self.deadline_s if self.deadline_s is not None else 0.1)",
           "        self.fence.wait(seq - 1, None)",
           ("tests/test_draft_priority.py",)),
    Mutant("s23-config-priority-default-off", "draft_priority is on unless switched off",
           "config.py", "    draft_priority: bool = True ", "    draft_priority: bool = False ",
           ("tests/test_draft_priority.py", "tests/test_config.py")),
)
