"""Rule mutants of the three modules with the fewest (twenty-second session): the request decoder
(``protocol/messages.py``), the step input's checks (``transport/api.py``) and the server's op handlers
(``server/service.py``). Each is written from a rule a user or operator relies on (a bad message gets a
clear typed error, a full step is accepted, one request's or one batch group's failure is its own), not
from the tests; each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

S22_MUTANTS = (
    # ------------------------------------------------------------- protocol/messages.py
    Mutant("s22-message-at-limit-refused", "a message of exactly the advertised max_message_bytes is accepted",
           "protocol/messages.py", "        if total > max_bytes:", "        if total >= max_bytes:",
           ("tests/test_protocol.py::test_a_message_of_exactly_the_advertised_limit_is_accepted",
            "tests/test_protocol.py")),
    Mutant("s22-attach-slot-dtype-unchecked", "an attach whose slots hold another dtype than it declares is BAD_FIELD",
           "protocol/messages.py",
           "t.shape != [msg.capacity, msg.width] or t.dtype != msg.dtype for t in msg.slots)",
           "t.shape != [msg.capacity, msg.width] for t in msg.slots)",
           ("tests/test_protocol.py::test_an_attach_whose_slots_hold_another_dtype_than_it_declares_is_refused",
            "tests/test_device_plane.py", "tests/test_protocol.py")),
    Mutant("s22-row-count-negative-unchecked", "a row message with a negative n, rows or width is BAD_FIELD",
           "protocol/messages.py", "        if msg.n < 0 or msg.rows < 0 or msg.width < 0 or msg.slot < -1:",
           "        if msg.n < 0 or msg.rows < 0 or msg.slot < -1:",
           ("tests/test_protocol.py::test_frame_errors", "tests/test_protocol.py", "tests/test_server_hostile.py")),
    # ------------------------------------------------------------- transport/api.py
    Mutant("s22-step-num-verified-unchecked", "num_verified of another length than req_ids is a StepInputError",
           "transport/api.py", 'for name in ("num_accepted", "num_verified"):', 'for name in ("num_accepted",):',
           ("tests/test_transport_settings.py::test_inconsistent_step_input_names_the_field",
            "tests/test_transport_settings.py")),
    Mutant("s22-step-seeds-length-unchecked", "seeds of another length than req_ids is a StepInputError",
           "transport/api.py", "not len(self.temperature) == len(self.seeds) == r",
           "not len(self.temperature) == r",
           ("tests/test_transport_settings.py::test_inconsistent_step_input_names_the_field",
            "tests/test_transport_settings.py", "tests/test_protocol_sampling.py")),
    Mutant("s22-step-full-step-refused", "a step of exactly max_rows rows (max batched tokens) is accepted",
           "transport/api.py", "        if n > settings.max_rows:", "        if n >= settings.max_rows:",
           ("tests/test_transport_settings.py::test_a_step_of_exactly_max_rows_rows_is_accepted",
            "tests/test_transport_settings.py")),
    # ------------------------------------------------------------- server/service.py
    Mutant("s22-hello-longest-key-refused", "a session key of 16..128 characters (what ClientSettings allows) opens",
           "server/service.py", "if not low <= len(req.msg.session) <= high:",
           "if not low <= len(req.msg.session) < high:",
           ("tests/test_server.py::test_every_key_length_the_client_allows_opens_a_session", "tests/test_server.py")),
    Mutant("s22-engine-failure-fails-round", "an engine failure fails only its group's messages, the others draft",
           "server/service.py", "                self._group_failed(group, exc)\n        return Batch(",
           "                self._group_failed(jobs, exc)\n        return Batch(",
           ("tests/test_server_rules.py::test_an_engine_failure_fails_only_its_groups_messages_and_the_server_goes_on",
            "tests/test_server_rules.py", "tests/test_server_batching.py")),
    Mutant("s22-ingest-failures-unreported", "an ingest's per-request failures reach the client in its reply",
           "server/service.py", "        return self._ok(req, failures=_failures(admitted))",
           "        return self._ok(req)",
           ("tests/test_transport_client.py", "tests/test_server.py")),
)
