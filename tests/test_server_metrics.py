"""``/metrics`` and ``stats`` of a live server: per-session series with a bounded label set,
pool gauges, the engine step histogram, sessions listed with their requests and blocks."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server import ServerProcess
from helpers.wire import Wire, ints
from k3_accel import protocol as p
from k3_accel.server.metrics import MAX_SESSION_LABELS


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "ngram", "--block-size", "4", "--lease-s", "0")
    yield s
    assert s.stop() == 0


def samples(server) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(server.metrics()) for s in fam.samples}


def labels(found: dict, name: str) -> dict[str, float]:
    return {dict(k)["session"]: v for (n, k), v in found.items() if n == name}


def eventually(condition, what: str, timeout: float = 60):
    """Poll ``condition`` (it returns a true value when met) until a deadline; return its value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


def test_stats_and_gauges_describe_sessions_and_the_pool(server):
    a, b = Wire(server.address), Wire(server.address)
    try:
        a.ingest([(0, 0, list(range(9))), (1, 0, [1])]).raise_for_error()        # 3 + 1 blocks
        b.ingest([(0, 0, [1, 2])]).raise_for_error()
        a.call(p.Free([1])).raise_for_error()                                     # retained
        s = a.call(p.Stats()).raise_for_error().result
        name_a, name_b = s["session"], b.call(p.Stats()).result["session"]
        assert name_a != name_b and name_a.startswith("wire#")
        line_a, line_b = s["sessions"][name_a], s["sessions"][name_b]
        assert (line_a["active"], line_a["retained"], line_a["blocks"]) == (1, 1, 4)
        assert (line_b["active"], line_b["retained"], line_b["blocks"]) == (1, 0, 1)
        assert s["pool_blocks"] == a.caps.pool_blocks and s["pool_block_bytes"] == 4 * 32
        used = s["pool_blocks"] - s["pool_free_blocks"]
        assert used == sum(line["blocks"] for line in s["sessions"].values())

        def gauges_caught_up():
            found = samples(server)
            return found if found[("k3_draft_pool_used_blocks", ())] == used else None
        found = eventually(gauges_caught_up, "the pool gauge never showed the blocks in use")
        assert found[("k3_draft_pool_blocks", ())] == s["pool_blocks"]
        assert found[("k3_draft_active_requests", ())] == s["active"]
        assert found[("k3_draft_retained_requests", ())] == s["retained"]
        assert found[("k3_draft_sessions", ())] == len(s["sessions"])
        assert labels(found, "k3_draft_session_active_requests")[name_a] == 1
        a.propose(2, [(0, 9, [], 3)]).raise_for_error()
        after = a.call(p.Stats()).result
        found = samples(server)
        assert found[("k3_draft_engine_step_seconds_count", ())] == after["engine_batches"] >= 1
        assert found[("k3_draft_engine_batch_size_count", ())] == after["engine_batches"]
    finally:
        for w in (a, b):
            w.call(p.Bye())
            w.close()


def test_per_session_series_are_bounded_and_ended_sessions_give_their_label_back(server):
    many = [Wire(server.address) for _ in range(MAX_SESSION_LABELS + 3)]
    try:
        for w in many:
            w.call(p.Ping()).raise_for_error()
        found = labels(samples(server), "k3_draft_session_messages_total")
        assert len(found) <= MAX_SESSION_LABELS + 1 and found.get("other", 0) >= 3
        for w in many:
            w.call(p.Bye()).raise_for_error()
        late = Wire(server.address)
        late.call(p.Ping()).raise_for_error()
        name = late.call(p.Stats()).result["session"]
        found = labels(samples(server), "k3_draft_session_messages_total")
        assert found.get(name) == 2 and len(found) <= MAX_SESSION_LABELS + 1
        late.call(p.Bye())
        late.close()
    finally:
        for w in many:
            w.close()


def test_shutting_down_replies_of_a_stopping_server_are_counted_as_errors():
    """Every error reply counts in ``k3_draft_errors`` by its code; those a stopping server gives what
    was still queued (``SHUTTING_DOWN``) did not."""
    import threading

    import zmq

    from helpers.service import LocalService
    from k3_accel.server.loop import ServerLoop

    local = LocalService()
    ctx = zmq.Context()
    loop = ServerLoop(local.service, ["tcp://127.0.0.1:0"], 1 << 26, ctx=ctx)

    def arrive(n: int) -> None:          # the loop driven by hand
        deadline = time.monotonic() + 60
        while sum(len(c.queue) for c in loop._conns.values()) < n:
            assert time.monotonic() < deadline, "the messages never reached the server"
            if loop.sock.poll(100):
                loop._receive_all()

    w = Wire(loop.endpoints[0], hello=False)
    try:
        w.send(p.Hello(w.session, "wire"))
        arrive(1)
        loop._round()
        assert w.recv().ok
        w.send(p.Ping())
        w.send(p.Stats())
        arrive(2)
        stop = threading.Event()
        stop.set()
        loop.serve(stop)                 # stops at once: the two queued messages are answered SHUTTING_DOWN
        assert [w.recv().error[0] for _ in range(2)] == ["SHUTTING_DOWN"] * 2
        metrics = local.service.metrics
        assert metrics.snapshot()["errors"] == {"SHUTTING_DOWN": 2}
        metrics.flush()
        assert metrics.registry.get_sample_value("k3_draft_errors_total", {"code": "SHUTTING_DOWN"}) == 2
    finally:
        w.close()
        ctx.term()


def test_hello_latency_is_its_handling_time(server):
    """``k3_draft_latency_seconds`` is the handling time by op; every hello was recorded as 0 s."""
    w = Wire(server.address)
    try:
        w.call(p.Ping()).raise_for_error()
        found = samples(server)
        hellos = found[("k3_draft_latency_seconds_count", (("op", "hello"),))]
        assert hellos >= 1 and hellos == found[("k3_draft_messages_total", (("op", "hello"),))]
        assert found[("k3_draft_latency_seconds_sum", (("op", "hello"),))] > 0
    finally:
        w.call(p.Bye())
        w.close()


def test_rows_a_reconnect_rebuilds_count_as_context_rows_stored(server):
    """``k3_draft_ingested_rows`` counts the context rows stored; a reconnect stores (rebuilds from its
    tokens) the rows past the prefix it shares with a stored context, and they were not counted."""
    w = Wire(server.address)
    try:
        stored = list(range(1, 21))
        w.ingest([(0, 0, stored)]).raise_for_error()
        before = w.call(p.Stats()).raise_for_error().result["ingested_rows"]
        scraped = samples(server)[("k3_draft_ingested_rows_total", ())]
        assert scraped == before
        reply = w.call(p.Reconnect(1, 21), ints(stored[:18] + [9, 9, 9])).raise_for_error()
        assert reply.result == {"restored": 18}                   # 18 forked, 3 rebuilt
        assert w.call(p.Stats()).raise_for_error().result["ingested_rows"] == before + 3
        assert samples(server)[("k3_draft_ingested_rows_total", ())] == before + 3
    finally:
        w.call(p.Bye())
        w.close()
