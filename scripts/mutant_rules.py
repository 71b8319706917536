"""The second mutant set (issue 25): bugs written from the rules a reviewer would fear, one module
at a time, not from the tests. Each names the rule it breaks and the tests that must notice.
``python scripts/mutants.py --set rules`` runs them; ``--set all`` runs both sets. The sibling files
``mutant_rules_{transport,vllm,server,tools,wave,s22,s22a,s22b,s23}.py`` hold one more per module the list below left out
(``--set modules`` runs only those).
"""
from __future__ import annotations

from mutant import Mutant
from mutant_rules_s22 import S22_MUTANTS
from mutant_rules_s22a import S22A_MUTANTS
from mutant_rules_s22b import S22B_MUTANTS
from mutant_rules_s23 import S23_MUTANTS
from mutant_rules_s24 import S24_MUTANTS
from mutant_rules_s25 import S25_MUTANTS
from mutant_rules_s26 import S26_MUTANTS
from mutant_rules_s28 import S28_MUTANTS
from mutant_rules_s29 import S29_MUTANTS
from mutant_rules_s30 import S30_MUTANTS
from mutant_rules_s30_server import S30_SERVER_MUTANTS
from mutant_rules_s31 import S31_MUTANTS
from mutant_rules_s32 import S32_MUTANTS
from mutant_rules_server import SERVER_MUTANTS
from mutant_rules_tools import TOOLS_MUTANTS
from mutant_rules_transport import TRANSPORT_MUTANTS
from mutant_rules_vllm import VLLM_MUTANTS
from mutant_rules_wave import WAVE_MUTANTS

V33 = ".venv-vllm033"           # mutants whose guarding tests need vLLM 0.33

FIRST_RULE_MUTANTS = (
    # ------------------------------------------------------------- server state
    Mutant("evict-oldest", "a session over its share gives back its newest requests", "server/state.py",
           "next((st for st in reversed(victim.active.values()) if id(st) not in protected), None)",
           "next((st for st in victim.active.values() if id(st) not in protected), None)",
           ("tests/test_server_state_machine.py",)),
    Mutant("in-flight-unprotected", "what one message of a batch admits, a later one does not take back",
           "server/state.py",
           "        return {id(s) for s in keep} | {id(s) for states in self.in_flight for s in states}",
           "        return {id(s) for s in keep}",
           ("tests/test_server_rules.py",)),
    Mutant("retained-newest-first", "a full pool drops the least recent retained context first", "server/state.py",
           "            for key in [k for k, s in self.retained.items()",
           "            for key in [k for k, s in reversed(self.retained.items())",
           ("tests/test_server_rules.py",)),
    Mutant("sources-of-all-sessions", "a reconnect reuses only its own session's contexts", "server/state.py",
           "yield from (s for (key, _), s in self.retained.items() if key == session.key)",
           "yield from (s for (key, _), s in self.retained.items())",
           ("tests/test_server_rules.py", "tests/test_server_state_machine.py")),
    Mutant("gives-way-to-further-over", "never give room to a session further over its share", "server/share.py",
           "    return theirs > 0 and theirs >= mine", "    return theirs > 0",
           ("tests/test_server_rules.py",)),
    Mutant("share-ignores-asker", "the asking session counts in the division", "server/share.py",
           "(0 if asking.wants_room() else asking.weight)", "0",
           ("tests/test_share.py", "tests/test_server_state_machine.py")),
    # ------------------------------------------------------------- server rows
    Mutant("negative-count", "a message with a negative count is refused whole", "server/rows.py",
           "if len(meta) and int(meta[:, :3].min()) < 0:", "if len(meta) and int(meta[:, :2].min()) < 0:",
           ("tests/test_server_hostile.py", "tests/test_server_state_machine.py")),
    Mutant("hidden-width", "hidden rows of another width are refused", "server/rows.py",
           "    if msg.width != caps.context_width:", "    if msg.width > caps.context_width:",
           ("tests/test_server_state_machine.py", "tests/test_server_dflash.py")),
    Mutant("reconnect-evicts-source", "a reconnect never evicts the context it copies from", "server/reconnect.py",
           "store.make_room(session, need, keep=[s for s in (source,) if s is not None])",
           "store.make_room(session, need, keep=[])",
           ("tests/test_server_rules.py",)),
    # ------------------------------------------------------------- engines
    Mutant("cow-room-unchecked", "a rewind into a shared block checks room for its copy first",
           "server/engines/pool.py",
           "            need += 1                              # the partial block is shared: it gets copied",
           "            pass",
           ("tests/test_server_rules.py",)),
    Mutant("fork-uncounted", "a fork holds a reference on every block it shares", "server/engines/pool.py",
           "        for b in shared:\n            self._refs[b] += 1", "        for b in shared:\n            pass",
           ("tests/test_server_state_machine.py",)),
    Mutant("ngram-long-index", "histories and chunks past 64 rows are indexed at their positions",
           "server/engines/ngram.py",
           "new = dict(zip(uniq.tolist(), (idx + lo).tolist()))", "new = dict(zip(uniq.tolist(), (idx + lo + 1).tolist()))",
           ("tests/test_ngram.py",)),
    # ------------------------------------------------------------- server edges
    Mutant("mixed-host-loopback", "a name resolving to any routable address is not loopback", "server/security.py",
           "    return bool(addrs) and all(ipaddress.ip_address(", "    return bool(addrs) and any(ipaddress.ip_address(",
           ("tests/test_curve.py",)),
    Mutant("closed-label-kept", "a closed or reclaimed session gives back its metric label", "server/metrics.py",
           '            self._add("closed", name, 0)', "            pass",
           ("tests/test_server_state_machine.py",)),
    Mutant("reclaim-skips-close", "a reclaimed session is closed like a goodbye (label, series)",
           "server/service.py", "        released = self._close(session)\n        self.metrics.reclaimed",
           "        released = self.store.close_session(session)\n        self.metrics.reclaimed",
           ("tests/test_server_state_machine.py",)),
    # ------------------------------------------------------------- transport
    Mutant("heartbeat-ignores-lease", "an idle client heartbeats within the advertised lease",
           "transport/client.py",
           "        self.sender.heartbeat_s = min(beat, caps.lease_s / 4) if caps.lease_s > 0 else beat\n", "",
           ("tests/test_transport_faults.py::test_an_idle_client_heartbeats_within_the_lease_the_server_advertises",)),
    Mutant("failure-blames-neighbour", "a per-request failure disables the request it names", "transport/outbox.py",
           "self.book.failures.push(kind, [ids[i]],", "self.book.failures.push(kind, [ids[min(i + 1, len(ids) - 1)]],",
           ("tests/test_transport_client.py::test_a_failure_disables_the_request_it_names_in_mixed_steps",)),
    Mutant("split-hidden-misaligned", "a split step sends each part's own hidden rows", "transport/outbox.py",
           "p.tensor_frame(slot.hidden[part.lo:part.hi])", "p.tensor_frame(slot.hidden[:part.hi - part.lo])",
           ("tests/test_transport_hidden.py::test_a_step_over_the_message_limit_is_split_with_its_hidden_rows",)),
    Mutant("aux-mismatch-accepted", "a server capturing other layers does not fit", "transport/handshake.py",
           "    if needs.aux_layer_ids and tuple(caps.aux_layer_ids) != tuple(needs.aux_layer_ids):",
           "    if False:", ("tests/test_doctor.py",)),
    Mutant("curve-fields-swapped", "each CURVE setting reaches its own client field", "transport/api.py",
           "curve_server_key=config.curve_server_key, curve_client_key=config.curve_client_key",
           "curve_server_key=config.curve_client_key, curve_client_key=config.curve_server_key",
           ("tests/test_transport_settings.py",)),
    # ------------------------------------------------------------- config, protocol, doctor
    Mutant("curve-env-swapped", "each CURVE variable sets its own setting", "config.py",
           '_Setting("curve_server_key", "VLLM_K3_DRAFT_CURVE_SERVER_KEY"',
           '_Setting("curve_server_key", "VLLM_K3_DRAFT_CURVE_CLIENT_KEY"',
           ("tests/test_transport_settings.py",)),
    Mutant("other-version-bad-field", "a peer of another version gets BAD_VERSION", "protocol/messages.py",
           "        if version is not None and version != PROTOCOL_VERSION:", "        if False:",
           ("tests/test_protocol.py",)),
    Mutant("doctor-always-yes", "doctor exits 0 only when vLLM would draft", "doctor.py",
           "    return 0 if report.ok else 1", "    return 0",
           ("tests/test_doctor.py",)),
    # ------------------------------------------------------------- the vLLM side
    Mutant("xpress-remote", "DFlash-method drafts vLLM drafts with other code stay local",
           "vllm/spec_decode/methods.py", 'or "XPress" in a]', "]",
           ("tests/test_vllm_methods.py",), V33),
    Mutant("aux-unsorted", "aux layer ids are vLLM's: ascending, each once", "vllm/spec_decode/session.py",
           "    return tuple(sorted(set(ids)))", "    return tuple(ids)",
           ("tests/test_doctor.py::test_doctor_against_a_dflash_server_whose_draft_lists_its_layers_out_of_order",)),
    Mutant("broadcast-skipped", "every TP rank reaches the drafts broadcast, also when rank 0's launch fails",
           "vllm/spec_decode/v2.py", "        session.broadcast(cols)\n",
           "        if seq is not None:\n            session.broadcast(cols)\n",
           ("tests/test_vllm_v2_tp.py::test_tp2_every_rank_reaches_the_broadcast_when_rank0_cannot_launch",), V33),
    # ------------------------------------------------------------- comm, demo
    Mutant("resume-forgets-threshold", "the DMA threshold survives a sleep-mode resume", "comm/router.py",
           "        dma.min_bytes = min_bytes\n", "", ("tests/test_comm_fault_vllm.py",)),
    Mutant("launcher-no-repick", "a picked port taken before the server binds is picked again", "demo/server.py",
           "                self.port, self.http_port = free_port(), free_port()\n", "",
           ("tests/test_launcher.py",)),
)

MODULE_MUTANTS = (TRANSPORT_MUTANTS + VLLM_MUTANTS + SERVER_MUTANTS + TOOLS_MUTANTS + WAVE_MUTANTS + S22_MUTANTS
                  + S22A_MUTANTS + S22B_MUTANTS + S23_MUTANTS + S24_MUTANTS + S25_MUTANTS + S26_MUTANTS
                  + S28_MUTANTS + S29_MUTANTS + S30_MUTANTS + S30_SERVER_MUTANTS
                  + S31_MUTANTS + S32_MUTANTS)
RULE_MUTANTS = FIRST_RULE_MUTANTS + MODULE_MUTANTS
