"""The demo report's verdicts follow the run's numbers (no vLLM: a scenario result built here)."""
from __future__ import annotations

import copy

import pytest

from k3_accel.demo.main import demo_rounds
from k3_accel.demo.report import format_report


def _round(label: str, outputs: list[list[int]], accepted: int = 0, drafts: int = 0, k: int = 4,
           counters: dict | None = None, proposals: int = 0) -> dict:
    return {"label": label, "outputs": [list(o) for o in outputs], "steps": 10, "generate_s": 0.5,
            "spec": {"drafts": drafts, "draft_tokens": drafts * k, "accepted": accepted},
            "accepted_per_pos": [accepted - accepted // 2, accepted // 2, 0, 0] if drafts else [],
            "client": {"counters": dict(counters or {}), "phases": {"round_trip": {"mean_ms": 1.5}}},
            "server": {"ops": {"propose": proposals}, "ingested_rows": 100, "tokens_proposed": drafts * k}}


def _result() -> dict:
    out = [[1, 2, 3], [4, 5, 6]]
    before = {"deferred_ingests": 2}                    # client counters are cumulative
    crashed = {**before, "disabled_requests": 2, "transport_errors": 1}
    with_ = [_round("long prompt", out, 3, 4, counters=before), _round("prompts", out, 5, 6, counters=before),
             _round("crash", out, counters=crashed), _round("restart", out, counters=crashed),
             _round("recovered", out, 1, 2, counters={**crashed, "server_restarts": 1}, proposals=3)]
    without = [_round(r["label"], r["outputs"]) for r in with_]
    return {"runs": [{"name": "without", "rounds": without, "start_s": 1.0},
                     {"name": "with", "rounds": with_, "start_s": 1.0}],
            "server": {"metrics_url": "http://127.0.0.1:1/metrics", "start_s": 0.5}, "build_s": 2.0,
            "build": {"target": {"train_s": 8.0},
                      "draft": {"total_s": 30.0, "acceptance": 0.45, "settings": {"k": 4}}}}


def test_the_scenario_rounds_carry_the_labels_the_report_reads():
    labels = [r.label for r in demo_rounds(faults=True)]
    assert labels == ["long prompt", "prompts", "crash", "restart", "recovered"]
    assert [r.actions for r in demo_rounds(faults=False)] == [[]] * 5
    assert any(a["do"] == "kill" for a in demo_rounds(faults=True)[2].actions)


def test_a_good_run_says_yes_with_its_numbers():
    report = format_report(_result(), "dflash", tiny="trained")
    assert "identical outputs  yes: 10 prompts in 5 rounds, 30 tokens" in report
    assert "drafts accepted    yes: 8 of 40 draft tokens (20.0%); 0.80 of 4 accepted per step" in report
    assert "by draft position: 50% 30% 0% 0%" in report
    assert "deferred ingest    yes: 2" in report
    assert "fails closed       yes" in report and "2 requests went on without drafts" in report
    assert "answered 3 proposals" in report
    assert "What it cannot show: speed" in report and "round_trip 1.50 ms" in report
    assert "trained in 8 s" in report and "held-out acceptance at K=4: 45%" in report


@pytest.mark.parametrize("breakage, line", [
    (lambda r: r["runs"][1]["rounds"][2]["outputs"].__setitem__(0, [9, 9, 9]), "identical outputs  NO"),
    (lambda r: [x["spec"].__setitem__("accepted", 0) for x in r["runs"][1]["rounds"][:2]], "drafts accepted    NO"),
    (lambda r: r["runs"][1]["rounds"][4]["server"]["ops"].__setitem__("propose", 0), "fails closed       NOT SEEN"),
    (lambda r: r["runs"][1]["rounds"][2]["client"]["counters"].__setitem__("disabled_requests", 0),
     "fails closed       NOT SEEN"),
    (lambda r: [x["client"]["counters"].__setitem__("deferred_ingests", 0) for x in r["runs"][1]["rounds"]],
     "deferred ingest    NOT SEEN"),
])
def test_a_bad_run_says_so(breakage, line):
    result = copy.deepcopy(_result())
    breakage(result)
    assert line in format_report(result, "dflash", tiny="trained")


def test_untrained_and_real_checkpoints_are_named():
    assert "tiny random target and draft (--untrained)" in format_report(_result(), "dflash", tiny="untrained")
    assert "checkpoints: your checkpoints" in format_report(_result(), "ngram", tiny=None)


def test_the_controller_line_says_what_it_measured():
    """`k3-accel demo --adaptive` reports the controller's own measurements, a plain forward and one
    that verified drafts apart (a draft server on the target's cores makes the second dearer)."""
    from k3_accel.demo.report import _controller
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings
    c = Controller(ControllerSettings(k_max=4))
    for n in range(8):
        c.cost.observe(8 + n, 0.004 + 0.0001 * (8 + n))                 # plain forwards
        c.cost.observe(40 + n, 0.012 + 0.0001 * (40 + n), True)         # forwards that verified drafts
    c.cost.observe_round_trip(0.005)
    line = _controller({"controller": c.snapshot()})
    assert "target step 4.00 ms + 100.0 us/token (12.00 ms" in line, line
    assert "draft round trip 5.00 ms" in line, line
    assert _controller({}).startswith("fixed K")
