"""The draft server as a real subprocess on loopback, driven over real sockets."""
from __future__ import annotations

import re
import signal
import subprocess
import sys

import msgpack
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, Free, Ingest, Propose, ProposeItem, Reconnect, RowSpan
from conftest import SRC, ServerProcess, Wire, http_get
from rows import rows

HISTORY = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]   # repetitive: prompt lookup proposes 7 8 5 6 ...


def ingest(wire, req_id, start, tokens):
    return wire.call(Ingest([RowSpan(req_id, len(tokens))]), rows((start, tokens)))


def propose(wire, items, k=4, tensors=None):
    return wire.call(Propose(k=k, requests=items), tensors)


def results(reply):
    return {r["id"]: r for r in reply.body["results"]}


def stats(wire):
    return wire.call(p.Stats()).raise_for_error().body["stats"]


def test_hello_reports_capabilities_and_server_id(wire):
    reply = wire.call(p.Hello("test"))
    caps = p.caps_from_body(reply.raise_for_error().body["caps"])
    assert caps.engine == "ngram" and not caps.needs_hidden_states
    assert caps.max_spec_tokens == 8 and caps.max_requests == 8 and caps.block_size == 4
    assert caps.protocol == p.PROTOCOL_VERSION and reply.server_id


def test_server_id_changes_on_restart():
    ids = []
    for _ in range(2):
        server = ServerProcess("--engine", "ngram")
        w = Wire(server.address)
        ids.append(w.call(p.Hello()).server_id)
        w.close()
        assert server.stop() == 0
    assert ids[0] != ids[1]


def test_ingest_then_propose_gives_prompt_lookup(wire):
    assert results(ingest(wire, "a", 0, HISTORY[:6]))["a"]["ok"]
    # remaining context arrives with the proposal; anchor is the next token
    reply = propose(wire, [ProposeItem("a", 3, anchor_token=HISTORY[9], anchor_position=9)], k=4,
                    tensors=rows((6, HISTORY[6:9])))
    assert results(reply)["a"]["ok"]
    assert reply.tensors["drafts"].tolist() == [[7, 8, 5, 6]]
    timing = reply.body["timing"]
    assert {"store", "engine", "handle"} <= set(timing) and timing["handle"] >= timing["engine"] > 0
    s = stats(wire)
    assert s["ingested_rows"] == 9 and s["ops"]["ingest"] == 1 and s["ops"]["propose"] == 1
    assert s["proposals"] == 1 and s["tokens_proposed"] == 4


def test_ingest_computes_no_draft(wire):
    ingest(wire, "a", 0, HISTORY)
    assert stats(wire)["proposals"] == 0


def test_rewind_after_rejected_drafts(wire):
    ingest(wire, "a", 0, [1, 2, 3, 1, 2, 3])
    first = propose(wire, [ProposeItem("a", 0, anchor_token=1, anchor_position=6)])
    assert first.tensors["drafts"].tolist() == [[2, 3, 1, -1]]
    # rows that start inside the stored context replace it from there on
    reply = propose(wire, [ProposeItem("a", 3, anchor_token=4, anchor_position=6)],
                    tensors=rows((3, [4, 5, 6])))
    assert results(reply)["a"]["ok"]
    assert reply.tensors["drafts"].tolist() == [[5, 6, 4, -1]]


def test_context_gap_fails_only_that_request(wire):
    ingest(wire, "ok", 0, [1, 2, 3])
    ingest(wire, "gap", 0, [4, 5])
    reply = wire.call(Ingest([RowSpan("ok", 2), RowSpan("gap", 2)]), rows((3, [1, 2]), (5, [6, 7])))
    res = results(reply)
    assert res["ok"]["ok"] and not res["gap"]["ok"] and res["gap"]["code"] == "CONTEXT_GAP"
    drafts = propose(wire, [ProposeItem("ok", 0, 3, 5), ProposeItem("gap", 0, 4, 2)], k=2)
    assert results(drafts)["gap"]["ok"]       # its stored context (length 2) is untouched
    assert drafts.tensors["drafts"][0].tolist() == [1, 2]


def test_anchor_must_follow_context(wire):
    ingest(wire, "a", 0, [1, 2, 3])
    reply = propose(wire, [ProposeItem("a", 0, anchor_token=1, anchor_position=5)])
    assert results(reply)["a"]["code"] == "CONTEXT_GAP"
    assert reply.tensors["drafts"].tolist() == [[-1, -1, -1, -1]]


def test_k_above_server_max_is_refused(wire):
    reply = propose(wire, [ProposeItem("a", 0, 1, 0)], k=9)
    assert not reply.ok and reply.error["code"] == "K_TOO_LARGE"


def test_free_and_clear(wire):
    ingest(wire, "a", 0, [1, 2, 3])
    ingest(wire, "b", 0, [1, 2, 3])
    wire.call(Free(["a"], retain=False)).raise_for_error()
    s = stats(wire)
    assert s["active"] == 1 and s["retained"] == 0
    # a freed request starts again: its old context is gone
    assert results(propose(wire, [ProposeItem("a", 0, 1, 3)]))["a"]["code"] == "CONTEXT_GAP"
    wire.call(p.Clear()).raise_for_error()
    s = stats(wire)
    assert s["active"] == 0 and s["retained"] == 0 and s["used_bytes"] == 0


def test_reconnect_match_and_mismatch(wire):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    ingest(wire, "old", 0, prompt)
    wire.call(Free(["old"])).raise_for_error()              # retained
    assert stats(wire)["retained"] == 1
    ok = wire.call(Reconnect("old", "new", 8), {"token_ids": torch.tensor(prompt[:8])})
    assert ok.raise_for_error().body["restored"] == 8
    # the new request continues from position 8
    reply = propose(wire, [ProposeItem("new", 1, anchor_token=1, anchor_position=9)], tensors=rows((8, [9])))
    assert results(reply)["new"]["ok"] and reply.tensors["drafts"][0, 0].item() == 2
    bad = wire.call(Reconnect("old", "other", 8), {"token_ids": torch.tensor([1, 2, 3, 4, 5, 6, 7, 99])})
    assert not bad.ok and bad.error["code"] == "PREFIX_MISMATCH"
    unaligned = wire.call(Reconnect("old", "other", 6), {"token_ids": torch.tensor(prompt[:6])})
    assert unaligned.error["code"] == "BAD_REQUEST"
    missing = wire.call(Reconnect("nope", "other", 4), {"token_ids": torch.tensor(prompt[:4])})
    assert missing.error["code"] == "UNKNOWN_REQUEST"


def test_retained_requests_are_lru_bounded(wire):
    for name in "abc":
        ingest(wire, name, 0, [1, 2, 3, 4])
    wire.call(Free(["a", "b", "c"])).raise_for_error()     # --max-retained-requests 2
    assert stats(wire)["retained"] == 2
    evicted = wire.call(Reconnect("a", "x", 4), {"token_ids": torch.tensor([1, 2, 3, 4])})
    assert evicted.error["code"] == "UNKNOWN_REQUEST"
    kept = wire.call(Reconnect("c", "y", 4), {"token_ids": torch.tensor([1, 2, 3, 4])})
    assert kept.raise_for_error().body["restored"] == 4


def test_too_many_requests(wire):
    for i in range(8):
        ingest(wire, f"r{i}", 0, [1])
    reply = ingest(wire, "r8", 0, [1])
    assert results(reply)["r8"]["code"] == "TOO_MANY_REQUESTS"
    assert stats(wire)["active"] == 8


def test_capacity_error_keeps_stored_state():
    server = ServerProcess("--engine", "ngram", "--memory-budget-mb", "1", "--max-retained-requests", "0")
    w = Wire(server.address)
    try:
        from k3_accel.server.engines.ngram import NgramEngine
        per_row = NgramEngine().bytes_per_row           # the server's defaults
        n = (1 << 20) // per_row - 10                   # just under one MiB
        assert results(ingest(w, "a", 0, [1] * n))["a"]["ok"]
        reply = ingest(w, "b", 0, [2] * 100)
        assert results(reply)["b"]["code"] == "CAPACITY"
        s = stats(w)
        assert s["active"] == 1 and s["used_bytes"] == n * per_row
    finally:
        w.close()
        assert server.stop() == 0


# ---------------------------------------------------------------- hostile input
def _raw(wire, frames):
    wire.send_frames(frames)
    return wire.recv()


def _header(**overrides):
    h = {"v": p.PROTOCOL_VERSION, "op": "stats", "seq": 7, "body": {}, "tensors": []}
    h.update(overrides)
    return msgpack.packb(h)


HOSTILE = {
    "not msgpack": ([b"\xc1\xc1 not msgpack"], "BAD_FRAME"),
    "not a map": ([msgpack.packb([1, 2])], "BAD_FRAME"),
    "wrong version": ([_header(v=99)], "BAD_VERSION"),
    "unknown op": ([_header(op="explode")], "UNKNOWN_OP"),
    "missing header field": ([msgpack.packb({"v": 1, "op": "stats", "seq": 1, "body": {}})], "BAD_FIELD"),
    "extra body field": ([_header(op="free", body={"ids": [], "zap": 1})], "BAD_FIELD"),
    "missing body field": ([_header(op="free", body={})], "BAD_FIELD"),
    "wrong field type": ([_header(op="propose", body={"k": "4", "requests": []})], "BAD_FIELD"),
    "missing frame": ([_header(tensors=[["x", "int64", [2], 16]])], "FRAME_MISMATCH"),
    "extra frame": ([_header(), b"12345678"], "FRAME_MISMATCH"),
    "short frame": ([_header(tensors=[["x", "int64", [2], 16]]), b"1234"], "FRAME_MISMATCH"),
    "nbytes vs shape": ([_header(tensors=[["x", "int64", [3], 16]]), b"x" * 16], "FRAME_MISMATCH"),
    "bad dtype": ([_header(tensors=[["x", "complex64", [1], 8]]), b"x" * 8], "BAD_FIELD"),
    "declared too large": ([_header(tensors=[["x", "uint8", [1 << 40], 1 << 40]])], "TOO_LARGE"),
    "rows vs counts": ([_header(op="ingest", body={"requests": [{"id": "z", "count": 3}]},
                                tensors=[["positions", "int64", [1], 8], ["token_ids", "int64", [1], 8]]),
                        b"\0" * 8, b"\0" * 8], "BAD_REQUEST"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_gets_typed_error_and_state_survives(wire, case):
    ingest(wire, "keep", 0, HISTORY)
    frames, code = HOSTILE[case]
    reply = _raw(wire, frames)
    assert not reply.ok and reply.error["code"] == code, reply.error
    assert reply.server_id
    survivor = propose(wire, [ProposeItem("keep", 0, anchor_token=7, anchor_position=len(HISTORY))])
    assert survivor.tensors["drafts"].tolist() == [[8, 5, 6, 7]]


def test_error_reply_echoes_seq(wire):
    reply = _raw(wire, [_header(op="explode", seq=4242)])
    assert reply.seq == 4242 and reply.error["code"] == "UNKNOWN_OP"


def test_oversized_message_is_dropped_by_maxmsgsize_and_server_lives():
    server = ServerProcess("--engine", "ngram", "--max-message-mb", "1")
    try:
        big = Wire(server.address, timeout_ms=1500)
        big.send_frames([_header(), b"x" * (3 << 20)])
        with pytest.raises(TimeoutError):
            big.recv()
        big.close()
        w = Wire(server.address)
        assert w.call(p.Stats()).ok
        w.close()
    finally:
        assert server.stop() == 0


def test_nan_hidden_rows_rejected_per_request(tmp_path):
    from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
    target = write_tiny_target(tmp_path / "t")
    draft = write_tiny_dflash(tmp_path / "d", target)
    server = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target))
    w = Wire(server.address)
    try:
        width = p.caps_from_body(w.call(p.Hello()).body["caps"]).context_width
        t = rows((0, [1, 2, 3]), (0, [4, 5, 6]), width=width)
        t["hidden"][4, 0] = float("nan")
        reply = w.call(Ingest([RowSpan("good", 3), RowSpan("poison", 3)]), t)
        res = results(reply)
        assert res["good"]["ok"] and res["poison"]["code"] == "NON_FINITE"
        s = stats(w)
        assert s["active"] == 1 and s["ingested_rows"] == 3
        drafts = propose(w, [ProposeItem("good", 0, anchor_token=7, anchor_position=3)], k=3)
        assert results(drafts)["good"]["ok"] and (drafts.tensors["drafts"] >= 0).all()
    finally:
        w.close()
        assert server.stop() == 0


# ---------------------------------------------------------------- HTTP + process
def test_health_ready_and_metrics(ngram_server, wire):
    ingest(wire, "a", 0, HISTORY)
    propose(wire, [ProposeItem("a", 0, anchor_token=7, anchor_position=len(HISTORY))])
    _raw(wire, [b"junk"])
    assert http_get(ngram_server.http_port, "/healthz")[0] == 200
    assert http_get(ngram_server.http_port, "/readyz")[0] == 200
    code, text = http_get(ngram_server.http_port, "/metrics")
    assert code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("k3_draft_ingested_rows_total", ())] == len(HISTORY)
    assert samples[("k3_draft_proposals_total", ())] == 1
    assert samples[("k3_draft_tokens_proposed_total", ())] == 4
    assert samples[("k3_draft_errors_total", (("code", "BAD_FRAME"),))] == 1
    assert samples[("k3_draft_active_requests", ())] == 1
    assert samples[("k3_draft_latency_seconds_count", (("op", "propose"),))] == 1
    assert http_get(ngram_server.http_port, "/nothing")[0] == 404


@pytest.mark.parametrize("argv, needle", [
    (["--engine", "bogus"], "invalid choice"),
    (["--port", "70000"], "outside 0..65535"),
    (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["--engine", "dflash"], "--engine dflash needs --draft-model"),
    (["--max-requests", "0"], "outside >= 1"),
    (["--curve-secret-key", "x"], "go together"),
    (["--ngram-min", "4", "--ngram-max", "2"], "--ngram-min must be <="),
    (["--host", "0.0.0.0"], "not a loopback address"),
    (["--device", "cuda:0"], None),
])
def test_cli_validation_errors(argv, needle):
    import torch as _t
    if argv == ["--device", "cuda:0"]:
        if _t.cuda.is_available():
            pytest.skip("this machine has CUDA")   # the error path exists only without a GPU
        needle = "CUDA is not available"
    run = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", *argv], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC}, timeout=60)
    assert run.returncode == 2 and needle in run.stderr, run.stderr


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", "--help"], capture_output=True,
                         text=True, env={"PYTHONPATH": SRC}, timeout=60).stdout
    for flag in re.findall(r"--[a-z-]+", " ".join([
            "--engine --draft-model --target-model --device --dtype --host --port --http-port --max-requests",
            "--max-retained-requests --num-speculative-tokens --memory-budget-mb --curve-secret-key",
            "--curve-authorized-keys --allow-insecure-remote --log-level"])):
        assert flag in out


def test_malformed_checkpoint_fails_startup_with_a_message(tmp_path):
    draft, target = tmp_path / "d", tmp_path / "t"
    draft.mkdir(), target.mkdir()
    server = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                           ready=False)
    rc = server.proc.wait(60)
    out = server.proc.stdout.read()
    assert rc == 1 and "cannot load the dflash engine" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_answers_queued_messages(sig):
    server = ServerProcess("--engine", "ngram")
    w = Wire(server.address)
    assert w.call(p.Stats()).ok
    server.proc.send_signal(sig)
    assert server.proc.wait(15) == 0
    w.close()


def test_dflash_server_drafts_match_a_from_scratch_recomputation(tmp_path):
    """Chunked ingest, propose, a rejection (rewind), propose again — over real sockets."""
    from k3_accel.server.engines.dflash import load_dflash
    from k3_accel.server.engines.dflash.model import reference_propose
    from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
    target = write_tiny_target(tmp_path / "t")
    draft = write_tiny_dflash(tmp_path / "d", target)
    weights = load_dflash(draft, target)
    server = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target))
    w = Wire(server.address)
    try:
        width = p.caps_from_body(w.call(p.Hello()).raise_for_error().body["caps"]).context_width
        ctx = rows((0, list(range(10, 30))), width=width, seed=3)
        for lo, hi in ((0, 7), (7, 20)):             # two ingest chunks
            chunk = {name: t[lo:hi] for name, t in ctx.items()}
            assert results(w.call(Ingest([RowSpan("r", hi - lo)]), chunk))["r"]["ok"]
        got = propose(w, [ProposeItem("r", 0, anchor_token=42, anchor_position=20)], k=5).tensors["drafts"][0]
        want, _ = reference_propose(weights, ctx["hidden"], ctx["positions"], 42, 5)
        assert torch.equal(got, want)
        # the target rejected from position 16 on: new rows replace 16.., then propose
        new = rows((16, [7, 8, 9]), width=width, seed=4)
        reply = propose(w, [ProposeItem("r", 3, anchor_token=5, anchor_position=19)], k=5, tensors=new)
        accepted_h = torch.cat([ctx["hidden"][:16], new["hidden"]])
        want, _ = reference_propose(weights, accepted_h, torch.arange(19), 5, 5)
        assert torch.equal(reply.tensors["drafts"][0], want)
    finally:
        w.close()
        assert server.stop() == 0


def test_installed_console_script_answers_readyz():
    """`k3-draft-server --engine ngram` from the install (the console script, not -m)."""
    import os
    import time
    from pathlib import Path
    from conftest import free_port
    script = Path(sys.executable).parent / "k3-draft-server"
    assert script.exists(), "k3-accel is not installed in this environment"
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([str(script), "--engine", "ngram", "--port", str(port), "--http-port", str(http_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        deadline = time.time() + 60
        status = None
        while time.time() < deadline and status != 200:
            try:
                status = http_get(http_port, "/readyz")[0]
            except OSError:
                time.sleep(0.2)
        assert status == 200
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
