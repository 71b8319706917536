"""Rule mutants of the client side (``transport/``) that the first rule set left out: one per module.
Written from each module's rule (its docstring), not from its tests."""
from __future__ import annotations

from mutant import Mutant

TRANSPORT_MUTANTS = (
    Mutant("link-restart-unnoticed", "a restarted server (new server_id) means all remote state is gone",
           "transport/link.py", '        self.on_state_lost(f"server restarted ({old} -> {new})")\n', "",
           ("tests/test_transport_client.py::test_server_restart_disables_everything_and_new_requests_draft",)),
    Mutant("sender-error-swallowed", "a deferred ingest that fails to send fails its requests closed",
           "transport/sender.py", "                if job.on_error is not None:\n                    job.on_error(exc)\n",
           "", ("tests/test_transport_faults.py",)),
    Mutant("layout-interleaved-as-is", "the slot holds the ingest group's rows, then the propose group's",
           "transport/layout.py",
           "not self.ingest.size or not self.propose.size or self.ingest[-1] < self.propose[0]):", "True):",
           ("tests/test_transport_staging.py", "tests/test_transport_client.py::test_mixed_step_splits_ingest_and_propose")),
    Mutant("staging-reuses-held-slot", "a slot still on the wire is never rewritten (back-pressure)",
           "transport/staging.py", "        while self.busy(slot):", "        while False:",
           ("tests/test_transport_staging.py",)),
    Mutant("failures-drained-twice", "a failure is drained exactly once", "transport/failures.py",
           "            items, self._items = self._items, []", "            items = list(self._items)",
           ("tests/test_transport_failures.py",)),
    Mutant("capture-stems-fold-case", "distinct request ids get distinct capture files, also case-insensitively",
           "transport/capture.py", "c if c in _SAFE else", "c.lower() if c.lower() in _SAFE else",
           ("tests/test_transport_capture.py",)),
    Mutant("timing-drops-async-counts", "counts from other threads appear in the stats",
           "transport/timing.py", "            counters = self.counters + self._async",
           "            counters = Counter(self.counters)",
           ("tests/test_transport_client.py", "tests/test_transport_settings.py", "tests/test_transport_faults.py")),
    Mutant("book-quota-plus-one", "a client never exceeds the server's per-session quota", "transport/book.py",
           "        if self.limit and self._active >= self.limit:", "        if self.limit and self._active > self.limit:",
           ("tests/test_transport_client.py::test_requests_beyond_the_servers_limit_are_not_drafted_and_not_errors",)),
    Mutant("reply-later-fails-older", "a reply to a later message fails the older unanswered one (the server "
           "answers in order: it never got it)", "transport/connection.py", "        if first != reply.seq:",
           "        if False:",
           ("tests/test_transport_faults.py::test_a_message_the_restarted_server_never_got_does_not_hold_its_slot_until_its_timeout",)),
    Mutant("reply-extras-misaligned", "a reply's extra tensors land on the rows of the requests that proposed",
           "transport/replies.py", "                    full[index] = t", "                    full[:len(t)] = t",
           ("tests/test_transport_client.py", "tests/test_transport_hidden.py")),
)
