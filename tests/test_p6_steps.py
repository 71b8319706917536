"""The benchmark-only step trace of P6 (benchmarks/p6_steps.py): it times the runner's calls and the
drafter's propose on the instance, puts back exactly what it found, and names the slowest step with
what overlapped it."""
from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import p6_steps  # noqa: E402


class Runner:
    def __init__(self):
        self.speculator = types.SimpleNamespace(propose=lambda n: n + 1)

    def execute_model(self):
        return "out"

    def sample_tokens(self):
        return self.speculator.propose(1)


def test_every_call_is_recorded_and_uninstall_puts_back_what_was_there():
    runner = Runner()
    worker = types.SimpleNamespace(model_runner=runner)
    plain_propose = runner.speculator.propose
    assert p6_steps.install_on_worker(worker) == 3
    try:
        p6_steps.clear_on_worker(worker)
        for _ in range(6):
            assert runner.execute_model() == "out" and runner.sample_tokens() == 2
        records = p6_steps.take_on_worker(worker)
        assert p6_steps.take_on_worker(worker) == []                  # taken once
    finally:
        assert p6_steps.uninstall_on_worker(worker) == 3
    names = [r[0] for r in records if not r[0].startswith("gc")]
    assert names == ["execute_model", "propose", "sample_tokens"] * 6      # propose ends inside sample_tokens
    assert "execute_model" not in vars(runner) and "sample_tokens" not in vars(runner)   # the class's again
    assert runner.speculator.propose is plain_propose                                  # the instance's own


def test_the_slowest_step_is_named_with_the_calls_that_overlapped_it():
    ms = 1e-3
    records = []
    starts = [0, 2, 4, 6, 56, 58, 60]                                 # the step at 6 ms takes 50 ms
    for i, t in enumerate(starts):
        records.append(("execute_model", t * ms, 0.5 * ms))
        records.append(("sample_tokens", (t + 0.6) * ms, (45 if i == 3 else 1) * ms))
    records.append(("gc2", 20 * ms, 3 * ms))
    out = p6_steps.summarise(records, top=1)
    assert out["steps"] == 7 and out["period_max_ms"] == 50.0 and out["period_median_ms"] == 2.0
    assert out["periods_over_4x_median"] == 1
    slow = out["slowest"][0]
    assert slow["period_ms"] == 50.0 and slow["at_ms"] == 6.0
    assert [name for name, _, _ in slow["overlapping"]] == ["execute_model", "sample_tokens", "gc2"]
    assert slow["overlapping"][1][2] == 45.0 and slow["overlapping"][2][1] == 14.0
    assert out["calls"]["sample_tokens"] == {"count": 7, "median_ms": 1.0, "max_ms": 45.0}


def test_each_step_records_the_batch_the_scheduler_gave_it():
    """Requests, scheduled tokens and draft slots of every step, in order, from the scheduler output
    (what says why one run took more steps than another for the same tokens)."""
    class Stepper:
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return None

        def sample_tokens(self):
            return None

    def output(reqs: int, drafts: int):
        ids = [f"r{i}" for i in range(reqs)]
        return types.SimpleNamespace(num_scheduled_tokens={r: 1 + drafts for r in ids},
                                     total_num_scheduled_tokens=reqs * (1 + drafts),
                                     scheduled_spec_decode_tokens={r: [-1] * drafts for r in ids if drafts})
    runner = Stepper()
    worker = types.SimpleNamespace(model_runner=runner)
    assert p6_steps.install_on_worker(worker) == 2
    try:
        p6_steps.clear_on_worker(worker)
        for reqs, drafts in ((8, 7), (8, 7), (5, 0), (3, 7)):
            runner.execute_model(output(reqs, drafts))
            runner.sample_tokens()
        out = p6_steps.summarise(p6_steps.take_on_worker(worker), top=1)
    finally:
        p6_steps.uninstall_on_worker(worker)
    assert out["batches"] == [[8, 64, 56], [8, 64, 56], [5, 5, 0], [3, 24, 21]]
    assert out["slowest"][0]["batch"] in out["batches"]
