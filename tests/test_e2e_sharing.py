"""End to end on real vLLM engines: two engines in two processes share one draft server.

Both run the same prompts through one ``k3-draft-server --engine ngram``
(each is its own client session), with outputs compared to runs without
drafting. Engine A crashes mid-run (no goodbye on the wire); engine B goes
on, and its later round runs only after A is gone: its outputs and its
drafting are untouched, and the server reclaims A's session after its lease.
"""
from __future__ import annotations

import threading

import pytest

from helpers.server import ServerProcess
from helpers.steps import wait_until
from helpers.wire import Wire
from k3_accel import protocol as p
from k3_accel.demo.child import run_in_child
from k3_accel.demo.checkpoints import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 512, "max_num_seqs": 4, "dtype": "float32"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
P1 = ["one two three one two three one two three", [7, 8, 9, 7, 8, 9, 7, 8]]
P2 = ["a b c a b c a b c a b c", [3, 4, 3, 4, 3, 4, 3, 4]]
P3 = ["red green blue red green blue red green", [11, 12, 13, 11, 12, 13, 11]]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-sharing")
    target, _ = build_tiny(work, with_draft=False)
    server = ServerProcess("--engine", "ngram", "--lease-s", "3")
    b_drafting, a_gone = work / "b-drafting", work / "a-gone"

    def scenario(name: str, remote_rounds: list[Round], plain_rounds: list[Round]) -> Scenario:
        return Scenario(target=target, workdir=str(work / name), engine=ENGINE, server_address=server.address,
                        runs=[Run("none", plain_rounds), Run("remote", remote_rounds, speculative=SPEC, remote=True, plugin=FIXED_K)])

    a = scenario("a", [Round(P1, max_tokens=24),
                       Round(P2, max_tokens=64, actions=[{"step": 0, "do": "wait_file", "path": str(b_drafting)},
                                                         {"step": 6, "do": "crash", "path": str(a_gone)}])],
                 [Round(P1, max_tokens=24)])
    b_rounds = [Round(P1, max_tokens=24, actions=[{"step": 2, "do": "touch", "path": str(b_drafting)}]),
                Round(P2, max_tokens=24),
                Round(P3, max_tokens=24, actions=[{"step": 0, "do": "wait_file", "path": str(a_gone)}])]
    b = scenario("b", b_rounds, [Round(r.prompts, max_tokens=r.max_tokens) for r in b_rounds])
    out: dict = {}
    threads = [threading.Thread(target=lambda n, s, c: out.__setitem__(n, run_in_child(s, 1500, crash_ok=c)),
                                args=args) for args in (("a", a, True), ("b", b, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1600)
    wire = Wire(server.address)
    try:
        reclaimed = wait_until(lambda: wire.call(p.Stats()).result["sessions_reclaimed"] >= 1, timeout=60)
        stats = wire.call(p.Stats()).result
    finally:
        wire.close()
        server.stop()
    return out, reclaimed, stats


def runs(result: dict) -> dict:
    return {r["name"]: r for r in result["runs"]}


def test_e2e_two_engines_share_one_server(shared):
    out, _, _ = shared
    a, b = runs(out["a"]), runs(out["b"])
    assert out["a"].get("crashed") and not out["b"].get("crashed")
    # A's first round completed before it crashed: identical, and drafts were accepted
    assert a["remote"]["rounds"][0]["outputs"] == a["none"]["rounds"][0]["outputs"]
    assert a["remote"]["rounds"][0]["spec"]["accepted"] > 0
    for i in range(3):                                    # B: every round, the last one after A died
        assert b["remote"]["rounds"][i]["outputs"] == b["none"]["rounds"][i]["outputs"], i
        assert b["remote"]["rounds"][i]["spec"]["accepted"] > 0, i
    assert b["remote"]["rounds"][2]["client"]["counters"].get("disabled_requests", 0) == 0


def test_e2e_a_crashed_engines_session_is_reclaimed(shared):
    _, reclaimed, stats = shared
    assert reclaimed and stats["active"] == 0, stats
