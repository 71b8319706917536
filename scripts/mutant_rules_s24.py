"""Rule mutants of choosing while the reply travels (twenty-fourth session): on V2, while speculation
is on, a step goes out as a propose and the controller chooses during its wait; the choice is the
one choosing first makes; while speculation is off the step goes as an ingest, decided first; the
client runs the callback once a propose is out, before waiting. Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

S24_MUTANTS = (
    Mutant("s24-early-while-off", "while speculation is off a step is decided first and goes as an ingest",
           "vllm/spec_decode/controller.py", "and inp.k > 0 and not held and self._off == 0:",
           "and inp.k > 0 and not held:",
           ("tests/test_controller.py", "tests/test_pipeline_watchdog.py")),
    Mutant("s24-early-keeps-dropped-drafts", "a step chosen to draft nothing hands out no drafts, whatever came back",
           "vllm/spec_decode/controller.py", "        if not proposing and inp.k > 0:         # nobody drafts",
           "        if not proposing and inp.k > 0 and out is None:   # nobody drafts",
           ("tests/test_controller.py", "tests/test_pipeline_watchdog.py")),
    Mutant("s24-client-calls-back-after-the-reply", "the client calls back once the propose is out, before its reply",
           "transport/client.py",
           "        if pending is not None and while_waiting is not None:\n            while_waiting()\n"
           "        self._finish_step(inp, out, plan, pending)\n",
           "        self._finish_step(inp, out, plan, pending)\n"
           "        if pending is not None and while_waiting is not None:\n            while_waiting()\n",
           ("tests/test_transport_client.py",)),
)
