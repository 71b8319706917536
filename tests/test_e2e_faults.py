"""End to end on a real vLLM engine: the draft server fails, the target does not.

Rounds of prompts run through a remotely drafting engine while the draft
server is SIGKILLed mid-generation, restarted, SIGSTOPped (proposals time
out) and SIGCONTed. Every request completes with exactly the output of an
engine without speculation; after a restart and after a resume, new requests
draft again (the server's counters move). A warm-up round after each outage
gives the client the steps it needs to reconnect (it only works inside steps),
stepping short requests until the client reports it is connected again.
"""
from __future__ import annotations

import pytest

from k3_accel.demo.child import run_in_child
from k3_accel.demo.main import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "dtype": "float32"}
K = 3
TIMEOUT_MS = 1500
P = [
    ["The quick brown fox jumps over the lazy dog", "one two three one two three", [9, 8, 7, 6, 5, 4, 3]],
    ["Water boils at one hundred degrees", "Bread, cheese, apples"],
    ["Once upon a time there was a little village", "The children went to school", [40, 41, 42, 43]],
    ["Numbers like one, two, three", "Music played softly while the rain fell"],
]
WARM_UP = ["The library opened its doors at nine o'clock"]


def _rounds(faults: bool) -> list[Round]:
    def act(*actions):
        return list(actions) if faults else []
    return [
        Round(P[0], max_tokens=24, actions=act({"step": 4, "do": "kill"}), probe_server=False),  # 0: crash
        Round(WARM_UP, max_tokens=40, actions=act({"step": 0, "do": "restart"}), wait_ready=faults),
        Round(P[1], max_tokens=16),                                                               # 2: drafts again
        Round(P[2], max_tokens=24, actions=act({"step": 3, "do": "stop"}, {"step": 10, "do": "cont"})),
        Round(WARM_UP, max_tokens=40, wait_ready=faults),
        Round(P[3], max_tokens=16),                                                               # 5: recovered
    ]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-faults")
    target, draft = build_tiny(work)
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    scenario = Scenario(target=target, workdir=str(work), engine=ENGINE,
                        server_args=["--engine", "dflash", "--draft-model", draft, "--target-model", target],
                        runs=[Run("none", _rounds(faults=False)),
                              Run("remote", _rounds(faults=True), speculative=spec, remote=True,
                                  plugin={**FIXED_K, "draft_timeout_ms": TIMEOUT_MS})])
    out = run_in_child(scenario, timeout=900)
    return {r["name"]: r for r in out["runs"]} | {"server": out["server"]}


def test_every_request_completes_with_identical_output(result):
    expected = [r["outputs"] for r in result["none"]["rounds"]]
    got = [r["outputs"] for r in result["remote"]["rounds"]]
    assert got == expected
    assert result["server"]["starts"] == 2


def test_kill_fails_the_batch_closed(result):
    counters = result["remote"]["rounds"][0]["client"]["counters"]
    assert counters.get("transport_errors", 0) >= 1 or counters.get("failures.transport", 0) >= 1, counters
    assert counters.get("disabled_requests", 0) >= 1, counters


def test_after_a_restart_new_requests_draft_again(result):
    rounds = result["remote"]["rounds"]
    restarted = rounds[2]["server"]                      # the new server's counters start at zero
    assert restarted["ops"].get("propose", 0) > 0 and restarted["proposals"] > 0, restarted
    assert rounds[2]["client"]["counters"].get("server_restarts", 0) >= 1, rounds[2]["client"]["counters"]
    assert rounds[2]["spec"]["draft_tokens"] > 0


def test_a_stopped_server_times_out_and_generation_continues(result):
    rounds = result["remote"]["rounds"]
    counters = rounds[3]["client"]["counters"]
    assert counters.get("transport_errors", 0) > rounds[2]["client"]["counters"].get("transport_errors", 0), counters
    assert rounds[3]["outputs"] == result["none"]["rounds"][3]["outputs"]


def test_after_resume_new_requests_draft_again(result):
    rounds = result["remote"]["rounds"]
    before, after = rounds[3]["server"], rounds[5]["server"]
    assert after["proposals"] > before["proposals"], (before, after)
    disabled_before = rounds[4]["client"]["counters"].get("disabled_requests", 0)
    assert rounds[5]["client"]["counters"].get("disabled_requests", 0) == disabled_before
