"""The draft server as a real subprocess on loopback, driven over real sockets: the ops.

Every test talks in a session of its own (namespaces keep them apart) on one
shared server; server-wide counters are compared before and after.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.oracles import ngram_lookup
from helpers.ports import free_port
from helpers.server import ServerProcess, http_get, src_env
from helpers.wire import Wire, _rows, ints
from k3_accel import protocol as p

HISTORY = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]   # repetitive: prompt lookup proposes 7 8 5 6 ...
ARGS = ("--engine", "ngram", "--block-size", "4", "--max-requests", "8", "--max-retained-requests", "2",
        "--num-speculative-tokens", "8", "--lease-s", "0")   # (leases: test_server_sessions.py)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*ARGS)
    yield s
    assert s.stop() == 0


@pytest.fixture
def wire(server):
    w = Wire(server.address)
    yield w
    w.call(p.Bye())
    w.close()


def stats(w: Wire) -> dict:
    return w.call(p.Stats()).raise_for_error().result


def mine(w: Wire) -> dict:
    """This session's line of ``stats``."""
    s = stats(w)
    return s["sessions"][s["session"]]


def drafts(reply: p.Reply) -> list[list[int]]:
    return reply.raise_for_error().tensors["drafts"].tolist()


def lookup(history, k=4) -> list[int]:
    found = ngram_lookup(history, k)
    return found + [-1] * (k - len(found))


def delta(after: dict, before: dict, *keys) -> tuple:
    return tuple(after[k] - before[k] for k in keys)


def test_hello_reports_capabilities_and_server_id(wire):
    caps, reply = wire.caps, wire.call(p.Hello(wire.session, "again"))
    assert reply.ok and reply.server_id and p.caps_from_result(reply.result) == caps
    assert caps.engine == "ngram" and not caps.needs_hidden_states and caps.vocab_size == 0
    assert caps.max_spec_tokens == 8 and caps.max_requests == 8 and caps.block_size == 4
    assert caps.protocol == p.PROTOCOL_VERSION and caps.lease_s == 0.0
    assert caps.pool_blocks > 0 and caps.pool_bytes == caps.pool_blocks * 4 * 32
    assert caps.max_message_bytes == p.DEFAULT_MAX_MESSAGE_BYTES


def test_a_session_key_must_be_a_secret(server):
    w = Wire(server.address, hello=False)
    try:
        for key in ("", "short", "x" * 129):
            reply = w.call(p.Hello(key, "weak"))
            assert not reply.ok and reply.error[0] == "BAD_FIELD" and "16..128" in reply.error[1]
            assert w.call(p.Ping()).error[0] == "NO_SESSION"
        assert w.call(p.Hello("x" * 16, "ok")).ok and w.call(p.Ping()).ok
    finally:
        w.call(p.Bye())
        w.close()


@pytest.mark.parametrize("length", [16, 128])
def test_every_key_length_the_client_allows_opens_a_session(server, length):
    """ClientSettings takes a session key of 16..128 characters: the server opens each of them."""
    key = "k" * (length - 3) + f"{length:03d}"
    from k3_accel.transport.api import ClientSettings
    assert ClientSettings(address=server.address, session=key).session == key
    w = Wire(server.address, session=key)
    try:
        assert w.caps.engine == "ngram"
        w.ingest([(0, 0, HISTORY)]).raise_for_error()
        assert drafts(w.propose(4, [(0, len(HISTORY), [], 7)])) == [lookup(HISTORY + [7])]
    finally:
        w.call(p.Bye())
        w.close()


def test_ingest_then_propose_gives_prompt_lookup(wire):
    before = stats(wire)
    assert wire.ingest([(0, 0, HISTORY[:6])]).raise_for_error().failures == []
    # the rest of the context arrives with the proposal; the anchor is the next token
    reply = wire.propose(4, [(0, 6, HISTORY[6:9], HISTORY[9])])
    assert drafts(reply) == [lookup(HISTORY)] == [[7, 8, 5, 6]]
    store_s, engine_s = reply.result                # the server's phase timings
    assert store_s >= 0 and engine_s >= 0
    after = stats(wire)
    assert delta(after, before, "ingested_rows", "proposals", "tokens_proposed", "engine_batches") == (9, 1, 4, 1)
    assert after["ops"]["ingest"] - before["ops"].get("ingest", 0) == 1
    assert mine(wire)["active"] == 1


def test_ingest_computes_no_draft(wire):
    before = stats(wire)
    wire.ingest([(0, 0, HISTORY)]).raise_for_error()
    assert delta(stats(wire), before, "proposals", "engine_batches", "ingested_rows") == (0, 0, len(HISTORY))


def test_k_zero_stores_rows_without_drafting(wire):
    before = stats(wire)
    reply = wire.propose(0, [(0, 0, HISTORY, 7)])
    assert reply.ok and reply.tensors["drafts"].shape == (1, 0)
    assert delta(stats(wire), before, "engine_batches", "ingested_rows") == (0, len(HISTORY))
    assert drafts(wire.propose(4, [(0, len(HISTORY), [], 7)])) == [lookup(HISTORY + [7])]


def test_rows_inside_the_context_rewind_it(wire):
    stored = [1, 2, 3, 9, 1, 2, 3]
    wire.ingest([(0, 0, stored)]).raise_for_error()
    # the target rejected from position 4 on: the new row replaces 4.., the anchor follows it
    assert drafts(wire.propose(4, [(0, 4, [5], 3)])) == [lookup([1, 2, 3, 9, 5, 3])]
    assert lookup([1, 2, 3, 9, 5, 3]) != lookup(stored + [5, 3])       # (the un-rewound answer differs)
    # a rewind with no rows: the anchor sits at start + count = 5
    assert drafts(wire.propose(4, [(0, 5, [], 9)])) == [lookup([1, 2, 3, 9, 5, 9])]
    # rows that start at the anchor's position are the next context; past it is a gap
    assert drafts(wire.propose(4, [(0, 5, [9], 1)])) == [lookup([1, 2, 3, 9, 5, 9, 1])]
    gap = wire.propose(4, [(0, 7, [2], 3)])
    assert [f[:2] for f in gap.failures] == [(0, "CONTEXT_GAP")] and drafts(gap) == [[-1] * 4]
    assert drafts(wire.propose(4, [(0, 6, [], 1)])) == [lookup([1, 2, 3, 9, 5, 9, 1])]   # unchanged by it


def test_one_bad_request_fails_only_itself(wire):
    """Issue 7.4: a batch with bad requests (a context gap, an id outside the vocabulary):
    the others get their drafts, the bad ones' stored contexts are unchanged."""
    a, gap, bad = [1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [7, 8, 7]
    wire.ingest([(0, 0, a[:3]), (1, 0, gap), (2, 0, bad)]).raise_for_error()
    rows_before = mine(wire)
    reply = wire.propose(4, [(0, 3, a[3:], 3), (1, 7, [6], 5), (2, 1, [-5], 8), (3, 0, [9, 9], 9)])
    assert reply.ok and [f[:2] for f in reply.failures] == [(1, "CONTEXT_GAP"), (2, "BAD_REQUEST")]
    assert drafts(reply) == [lookup(a + [3]), [-1] * 4, [-1] * 4, lookup([9, 9, 9])]
    assert mine(wire)["active"] == rows_before["active"] + 1
    # the refused requests hold exactly what they held: their next drafts come from it
    assert drafts(wire.propose(4, [(1, 5, [], 4), (2, 3, [], 7)])) == [lookup(gap + [4]), lookup(bad + [7])]
    assert drafts(wire.propose(4, [(1, 6, [], 5)])) == [[-1] * 4]      # 6 > 5: nothing was stored at 5


def test_k_and_logits_modes_are_checked(wire):
    wire.ingest([(0, 0, HISTORY)]).raise_for_error()
    for kw, code in (({"k": 9}, "K_TOO_LARGE"), ({"k": -1}, "K_TOO_LARGE"),
                     ({"k": 2, "logits": "full"}, "UNSUPPORTED"), ({"k": 2, "logits": "topk", "topk": 2}, "UNSUPPORTED"),
                     ({"k": 2, "logits": "all"}, "BAD_FIELD")):
        reply = wire.propose(kw.pop("k"), [(0, len(HISTORY), [], 7)], **kw)
        assert not reply.ok and reply.error[0] == code, (kw, reply.error)
    assert drafts(wire.propose(2, [(0, len(HISTORY), [], 7)])) == [lookup(HISTORY + [7], 2)]


def test_free_and_clear(wire):
    wire.ingest([(0, 0, [1, 2, 3]), (1, 0, [1, 2, 3]), (2, 0, [4, 5])]).raise_for_error()
    wire.call(p.Free([0], retain=False)).raise_for_error()
    assert (mine(wire)["active"], mine(wire)["retained"]) == (2, 0)
    # a freed request starts again: its old context is gone
    assert [f[1] for f in wire.propose(4, [(0, 3, [], 1)]).failures] == ["CONTEXT_GAP"]
    wire.call(p.Free([1])).raise_for_error()                     # retained by default
    assert (mine(wire)["active"], mine(wire)["retained"]) == (1, 1)
    assert wire.call(p.Free([7, 8])).ok                          # unknown handles: nothing to do
    assert wire.call(p.Clear()).raise_for_error().result == {"released": 1}
    line = mine(wire)
    assert (line["active"], line["retained"], line["blocks"]) == (0, 0, 0)


def test_reconnect_reuses_the_longest_stored_prefix(wire):
    prompt = list(range(10, 40))
    wire.ingest([(0, 0, prompt)]).raise_for_error()
    wire.call(p.Free([0])).raise_for_error()                      # retained
    # a new request whose prompt shares 18 tokens with it
    tokens = prompt[:18] + [99, 98]
    reply = wire.call(p.Reconnect(1, len(tokens)), ints(tokens))
    assert reply.raise_for_error().result == {"restored": 18}
    assert drafts(wire.propose(4, [(1, 20, [], 12)])) == [lookup(tokens + [12])]
    # the preempted request itself resumes from its own retained context
    reply = wire.call(p.Reconnect(0, 30), ints(prompt))
    assert reply.raise_for_error().result == {"restored": 30}
    assert drafts(wire.propose(4, [(0, 30, [], 15)])) == [lookup(prompt + [15])]
    # nothing shared: rebuilt from the tokens (ngram needs no hidden rows)
    reply = wire.call(p.Reconnect(2, 5), ints([1, 2, 3, 1, 2]))
    assert reply.raise_for_error().result == {"restored": 0}
    assert drafts(wire.propose(4, [(2, 5, [], 3)])) == [lookup([1, 2, 3, 1, 2, 3])]
    assert mine(wire)["active"] == 3


def test_retained_requests_are_lru_bounded(wire):
    for handle in range(3):
        wire.ingest([(handle, 0, [handle + 1] * 4)]).raise_for_error()
    wire.call(p.Free([0, 1, 2])).raise_for_error()               # --max-retained-requests 2
    assert mine(wire)["retained"] == 2
    evicted = wire.call(p.Reconnect(5, 4), ints([1] * 4)).raise_for_error()
    kept = wire.call(p.Reconnect(6, 4), ints([3] * 4)).raise_for_error()
    assert evicted.result == {"restored": 0} and kept.result == {"restored": 4}


def test_too_many_requests_per_session(wire):
    reply = wire.ingest([(h, 0, [1]) for h in range(9)])
    assert [f[:2] for f in reply.failures] == [(8, "TOO_MANY_REQUESTS")]
    assert mine(wire)["active"] == 8
    reply = wire.ingest([(0, 1, [2]), (9, 0, [1])])              # active ones go on, new ones wait
    assert [f[:2] for f in reply.failures] == [(1, "TOO_MANY_REQUESTS")]
    wire.call(p.Free([3], retain=False)).raise_for_error()
    assert wire.ingest([(9, 0, [1])]).failures == []


def test_messages_before_hello_get_no_session(server):
    w = Wire(server.address, hello=False)
    try:
        for msg in (p.Stats(), p.Ping(), p.Clear()):
            reply = w.call(msg)
            assert not reply.ok and reply.error[0] == "NO_SESSION"
        assert not w.call(*_rows(p.Ingest, [(0, 0, [1, 2])], None)).ok
        assert w.call(p.Hello("h" * 32)).ok and w.call(p.Stats()).ok
    finally:
        w.close()


def test_health_ready_and_metrics(server, wire):
    def samples():
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(server.metrics()) for s in fam.samples}
    before = samples()
    wire.ingest([(0, 0, HISTORY)]).raise_for_error()
    wire.propose(4, [(0, len(HISTORY), [], 7)]).raise_for_error()
    wire.send_frames([b"junk"])
    assert wire.recv().error[0] == "BAD_FRAME"
    assert http_get(server.http_port, "/healthz")[0] == 200
    assert http_get(server.http_port, "/readyz")[0] == 200
    assert http_get(server.http_port, "/nothing")[0] == 404
    after = samples()

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert grew("k3_draft_ingested_rows_total") == len(HISTORY)
    assert grew("k3_draft_proposals_total") == 1 and grew("k3_draft_tokens_proposed_total") == 4
    assert grew("k3_draft_errors_total", (("code", "BAD_FRAME"),)) == 1
    assert grew("k3_draft_latency_seconds_count", (("op", "propose"),)) == 1
    assert grew("k3_draft_engine_step_seconds_count") == 1
    assert grew("k3_draft_engine_batch_size_sum") == 1


@pytest.mark.parametrize("argv, needle", [
    (["--engine", "bogus"], "invalid choice"),
    (["--port", "70000"], "outside 0..65535"),
    (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["--engine", "dflash"], "--engine dflash needs --draft-model"),
    (["--max-requests", "0"], "outside >= 1"),
    (["--lease-s", "-1"], "below 0"),
    (["--lease-s", "nan"], "not a finite number"),          # would never reclaim a session, silently
    (["--batch-wait-ms", "inf"], "not a finite number"),    # no bound on how long a round is held
    (["--batch-wait-ms", "nan"], "not a finite number"),
    (["--gpu-memory-fraction", "0"], "outside (0.0, 1.0]"),
    (["--curve-secret-key", "x"], "go together"),
    (["--ngram-min", "4", "--ngram-max", "2"], "--ngram-min must be <="),
    (["--host", "0.0.0.0"], "not a loopback address"),
    (["--ingest-coalesce-rows", "-1"], "outside >= 0"),
    (["--threads", "-1"], "outside >= 0"),
    (["--threads", "two"], "is not an integer"),
])
def test_cli_validation_errors(argv, needle, capsys):
    from k3_accel.server.cli import build_parser, validate
    ap = build_parser()
    with pytest.raises(SystemExit) as info:
        validate(ap.parse_args(argv), ap)
    assert info.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("extra, threads", [((), 1), (("--threads", "2"), 2)])
def test_a_server_launched_beside_its_client_runs_the_torch_threads_it_was_given(extra, threads):
    """The launcher of the demo, tests and benchmarks gives a CPU server one torch thread (it shares
    the machine's cores with the engine driving it) unless its flags say how many."""
    server = ServerProcess("--engine", "ngram", *extra)
    try:
        w = Wire(server.address)
        assert w.call(p.Stats()).result["threads"] == threads
        w.close()
    finally:
        server.stop()


def test_the_launcher_leaves_threads_alone_where_they_are_set_or_the_engine_is_on_a_gpu():
    from k3_accel.demo.server import beside_its_client
    assert beside_its_client(["--engine", "ngram"]) == ["--engine", "ngram", "--threads", "1"]
    assert beside_its_client(["--device", "cpu"])[-2:] == ["--threads", "1"]
    for args in (["--threads", "4"], ["--threads=4"], ["--device", "cuda:0"], ["--device=cuda"]):
        assert beside_its_client(args) == args


def test_cuda_device_is_checked_against_this_machine(capsys):
    import torch
    from k3_accel.server.cli import build_parser, validate
    ap = build_parser()
    args = ap.parse_args(["--device", "cuda:0"])
    if torch.cuda.is_available():
        validate(args, ap)                                     # accepted where there is a GPU
    else:
        with pytest.raises(SystemExit):
            validate(args, ap)
        assert "CUDA is not available" in capsys.readouterr().err


def test_help_documents_every_flag():
    """Every option of the parser appears in --help with a description of its own."""
    import argparse
    from k3_accel.server.cli import build_parser
    out = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", "--help"], capture_output=True,
                         text=True, env=src_env(), timeout=120).stdout
    actions = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 20
    for action in actions:
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
        for flag in action.option_strings:
            assert flag in out, flag


def test_server_id_changes_on_restart_and_state_is_gone():
    server = ServerProcess("--engine", "ngram")
    try:
        w = Wire(server.address, session="r" * 32)
        first = w.call(p.Stats()).server_id
        w.ingest([(0, 0, HISTORY)]).raise_for_error()
        w.close()
        server.restart()
        w = Wire(server.address, session="r" * 32)            # the same session key, a new server
        assert w.call(p.Stats()).server_id != first
        assert [f[1] for f in w.propose(4, [(0, len(HISTORY), [], 7)]).failures] == ["CONTEXT_GAP"]
        w.close()
    finally:
        assert server.stop() == 0


def test_malformed_checkpoint_fails_startup_with_a_message(tmp_path):
    draft, target = tmp_path / "d", tmp_path / "t"
    draft.mkdir(), target.mkdir()
    server = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                           ready=False, capture=True)
    rc = server.proc.wait(120)
    assert rc == 1 and "cannot load the dflash engine" in server.proc.stdout.read()


def test_installed_console_script_answers_readyz():
    """`k3-draft-server --engine ngram` from the install (the console script, not -m)."""
    import time
    script = Path(sys.executable).parent / "k3-draft-server"
    assert script.exists(), "k3-accel is not installed in this environment"
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([str(script), "--engine", "ngram", "--port", str(port), "--http-port", str(http_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and status != 200:
            try:
                status = http_get(http_port, "/readyz", timeout=1)[0]
            except OSError:
                time.sleep(0.1)
        assert status == 200
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_readyz_follows_the_engine_and_loop_readiness():
    """/readyz is 503 while the server is not ready (engine loading, sockets not bound: the CLI's
    ``loop.ready`` not set) and 200 only once it is; /healthz is 200 throughout. A real HTTP server
    on a loopback port, read over a socket; the readiness is the event the CLI hands it."""
    import threading

    from prometheus_client import CollectorRegistry

    from k3_accel.server.http import HealthServer

    ready = threading.Event()
    http = HealthServer("127.0.0.1", 0, CollectorRegistry(), ready=ready.is_set).start()
    try:
        assert http_get(http.port, "/healthz")[0] == 200
        code, body = http_get(http.port, "/readyz")
        assert code == 503 and "not ready" in body
        ready.set()
        assert http_get(http.port, "/readyz") == (200, "ready\n")
        ready.clear()                                   # e.g. the loop stopped accepting
        assert http_get(http.port, "/readyz")[0] == 503
    finally:
        http.close()
