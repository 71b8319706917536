"""Client rules the mutant set found unguarded (issue 25), each against a real n-gram draft server."""
from __future__ import annotations

import time

from helpers.oracles import ngram_lookup as lookup
from helpers.server import ServerProcess
from helpers.steps import step as rows

K = 4
SEQ = [1, 2] * 40           # one request's tokens: its n-gram drafts are the alternation


def drafts(history: list[int]) -> list[int]:
    found = lookup(history, K)
    return found + [-1] * (K - len(found))


def test_a_restart_between_steps_rearms_the_requests_the_old_server_held(client_factory):
    """The server restarts while nothing is in flight (the link sees no error; only the next reply's
    server_id tells): every request it held is gone with it, so the client asks for their histories
    and they draft again, instead of sending their next rows to a server that never saw the first."""
    srv = ServerProcess("--engine", "ngram")
    try:
        client = client_factory(srv.address, timeout_ms=2000)
        out = client.step(rows(["a"], [(0, SEQ[:3])], anchors=[SEQ[3]]))
        assert out.drafts[0].tolist() == drafts(SEQ[:4])
        srv.restart()
        resumed = None
        seq = SEQ * 25                   # room for a slow reconnect on a loaded box (steps come every 20 ms)
        for start in range(3, len(seq) - 2):
            out = client.step(rows(["a"], [(start, [seq[start]])], anchors=[seq[start + 1]],
                                   prompts={"a": seq[:start]}))
            if out.drafts[0, 0] >= 0:
                resumed = start
                break
            time.sleep(0.02)
        assert resumed is not None, "request 'a' never drafted again after the restart"
        assert out.drafts[0].tolist() == drafts(seq[:resumed + 2])
        assert client.stats()["counters"]["server_restarts"] >= 1
    finally:
        srv.stop()
