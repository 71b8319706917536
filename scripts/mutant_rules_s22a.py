"""Rule mutants of the client's transport plumbing (twenty-second session, helper a): the link
(``transport/link.py``), the staging ring (``transport/staging.py``), the slot layout and message
splitting (``transport/layout.py``) and the outbox (``transport/outbox.py``). Each is written from a
rule a user relies on (nothing lost or sent twice when a step is split, a slot is not rewritten while
a reply is outstanding, reconnect backoff is bounded, a server that forgot the session disables its
requests), not from the tests; each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

S22A_MUTANTS = (
    # ------------------------------------------------------------- transport/layout.py
    Mutant("s22a-split-drops-last-part", "a step cut into messages loses no row: the last part is sent too",
           "transport/layout.py", "    parts.append(_part(cur, lo, at))\n    return parts",
           "    return parts",
           ("tests/test_transport_staging.py::test_split_cuts_rows_into_messages_and_keeps_every_request",
            "tests/test_transport_staging.py", "tests/test_transport_client.py::test_oversized_step_is_split")),
    Mutant("s22a-tail-repeats-earlier-rows", "a split propose's last message carries only its own rows",
           "transport/layout.py", "    return Part(np.arange(len(counts)), starts + counts - keep, keep, lo,",
           "    return Part(np.arange(len(counts)), starts, keep, lo,",
           ("tests/test_transport_staging.py::test_tail_gives_every_request_its_rows_from_the_last_message",
            "tests/test_transport_staging.py", "tests/test_transport_client.py::test_oversized_step_is_split")),
    # ------------------------------------------------------------- transport/outbox.py
    Mutant("s22a-split-propose-rows-sent-twice", "rows of a split propose go out once: its last part is the propose",
           "transport/outbox.py", "                        for part in parts[:-1]]",
           "                        for part in parts]",
           ("tests/test_transport_client.py::test_oversized_step_is_split", "tests/test_transport_client.py",
            "tests/test_transport_hidden.py::test_a_step_over_the_message_limit_is_split_with_its_hidden_rows")),
    Mutant("s22a-abandoned-message-keeps-slot", "a message that will never be answered gives its slot back",
           "transport/outbox.py", "            release()\n            self.ring.retire(slot)",
           "            self.ring.retire(slot)",
           ("tests/test_transport_faults.py::test_close_with_work_in_flight_is_bounded_and_leaks_no_slot",
            "tests/test_transport_faults.py", "tests/test_transport_client.py")),
    # ------------------------------------------------------------- transport/staging.py
    Mutant("s22a-retired-slot-reused", "a slot whose memory may still be on the wire gets fresh memory before reuse",
           "transport/staging.py", "        if slot.retired:\n            self._renew(slot)",
           "        if False:\n            self._renew(slot)",
           ("tests/test_transport_staging.py::test_retired_slot_gets_fresh_memory_and_old_bytes_stay_untouched",
            "tests/test_transport_staging.py")),
    # ------------------------------------------------------------- transport/link.py
    Mutant("s22a-backoff-unbounded", "reconnect backoff doubles but never exceeds backoff_max_ms",
           "transport/link.py", "            self._backoff = min(self._backoff * 2, self.settings.backoff_max_ms / 1000)",
           "            self._backoff = self._backoff * 2",
           ("tests/test_rules_transport_s22.py::test_reconnect_backoff_doubles_but_never_waits_longer_than_backoff_max",
            "tests/test_transport_client.py::test_server_unreachable_at_start_then_appears",
            "tests/test_transport_faults.py")),
    Mutant("s22a-rehello-keeps-requests", "a server that reclaimed the session disables the requests it held",
           "transport/link.py", "        self.on_state_lost(why)\n", "",
           ("tests/test_rules_transport_s22.py::test_a_session_the_server_forgot_disables_every_request_it_held",
            "tests/test_transport_client.py", "tests/test_transport_faults.py")),
)
