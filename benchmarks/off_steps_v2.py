"""What an off step costs on the V2 runner: held from the launch on (``v2_held``) against launched.

While the adaptive controller keeps speculation off, every target step still hands the plugin its
rows. This drives the V2 remote speculator the way vLLM 0.33's V2 runner does, with vLLM's own
``VllmConfig`` / ``RequestState`` / ``InputBatch`` on the CPU (``tests/helpers/v2_sim.py``: the
target forward is simulated, its aux rows are made up), against a real ``k3-draft-server --engine
dflash`` serving the tiny draft, for B decode requests over ``--steps`` off steps, the controller held
off (measured: no draft pays, no probe due). Per off step, side by side (alternating variants):

* ``step_us``: the median wall time of ``propose`` on the calling thread (vLLM's step thread), and
  ``step_cpu_us`` its mean CPU time (the batch the runner builds is not timed);
* ``other_threads_cpu_us``: the CPU time of this process's other threads (the draft thread, the
  transport's) and ``server_cpu_us``: the server process's, per step, over the off steps and the
  flush that ships what is held (the server's clock ticks are 10 ms: read it over many steps);
* ``server_ingests``: the ingest messages the server handled.

On a GPU host the torch operations cost more host time each (20-40 us a call measured there) and the
server's ingest competes with the target for the GPU; this measures only what this machine can: the
work that is done or not. ``summary.ratio`` = held / launched ``step_us``, worst over B.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE), str(HERE.parent / "tests")]
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

from report import emit  # noqa: E402

from k3_accel.demo.server import DraftServer  # noqa: E402


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _held_off(spec) -> None:
    """The controller has measured that no draft pays (acceptance nil, a 5 ms round trip), and no
    probe is due for long. Without a measured round trip, a step cost it fits flat makes any draft
    free: before, it turned on after three steps (unnoticed while off steps were held regardless)."""
    ctl = spec.core.session.pipeline.controller
    ctl.acceptance.tried[:] = 1000.0
    ctl.cost.observe(1, 0.011)
    ctl.cost.observe(4, 0.014)
    ctl.cost.observe_round_trip(0.005)
    ctl._off, ctl._interval = 1, 10 ** 6


def run(config, server, b: int, steps: int, held: bool, tag: str) -> dict:
    from helpers.v2_sim import Sched, Sim
    from vllm.v1.worker.gpu import spec_decode

    sim = Sim(max_num_reqs=config.scheduler_config.max_num_seqs)
    spec = spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)
    try:
        if not held:
            spec.hold = None
        _held_off(spec)
        ids = [f"{tag}-{i}" for i in range(b)]
        prompt = list(range(5, 21))
        for rid in ids:
            sim.add(rid, prompt, max_tokens=steps + 8)
        sim.propose(spec, [Sched(rid, 0, prompt, sampled=3) for rid in ids], k=0)
        spec.flush()
        before = spec.core.session.pipeline.call(lambda c: c.server_stats())["ops"].get("ingest", 0)
        rs = sim.req_states
        temperature, seeds = torch.zeros(sim.max_num_reqs), torch.zeros(sim.max_num_reqs, dtype=torch.int64)
        cpu0, main0, srv0 = time.process_time(), time.thread_time(), _cpu_s(server.pid)
        times, step_cpu, last = [], 0.0, 3
        for t in range(steps):
            sched = [Sched(rid, len(prompt) + t, [last], sampled=7 + t % 50) for rid in ids]
            ib, aux, num_sampled, num_rejected = sim.batch(sched)          # the runner's part: not timed
            hidden = torch.zeros(ib.num_tokens, aux[0].shape[1], dtype=aux[0].dtype)
            t0, c0 = time.perf_counter(), time.thread_time()
            spec.propose(ib, {}, {}, hidden, aux, num_sampled, num_rejected, rs.last_sampled_tokens,
                         rs.next_prefill_tokens, temperature, seeds, num_speculative_tokens=0)
            times.append(time.perf_counter() - t0)
            step_cpu += time.thread_time() - c0
            last = 7 + t % 50
        spec.flush()
        others = (time.process_time() - cpu0) - (time.thread_time() - main0)
        srv = _cpu_s(server.pid) - srv0
        after = spec.core.session.pipeline.call(lambda c: c.server_stats())
        assert after["errors"] == {}, after["errors"]
        return {"step_us": statistics.median(times) * 1e6, "step_cpu_us": step_cpu / steps * 1e6,
                "other_threads_cpu_us": others / steps * 1e6, "server_cpu_us": srv / steps * 1e6,
                "server_ingests": after["ops"].get("ingest", 0) - before,
                "held_at_launch": spec.stats()["adapter"].get("held_at_launch", 0)}
    finally:
        spec.close()
        for rid in list(sim.req_states.req_id_to_index):
            sim.remove(rid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    from helpers.v2_sim import build_vllm_config, vllm_world

    from k3_accel.vllm.spec_decode import hooks

    os.environ.update(VLLM_K3_DRAFT_ADAPTIVE="on", VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS="20000")
    tag = itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        config = build_vllm_config(tmp, max_num_seqs=max(batches))
        server = DraftServer(["--engine", "dflash", "--draft-model", os.path.join(tmp, "draft"), "--target-model",
                              os.path.join(tmp, "target"), "--threads", "1", "--log-level", "WARNING"]).start()
        os.environ["VLLM_K3_DRAFT_REMOTE_ADDRESS"] = server.address
        hooks.install_v2()
        table = []
        try:
            with vllm_world(config):
                for b in batches:
                    runs: dict[str, list[dict]] = {"held": [], "launched": []}
                    for _ in range(args.repeats):
                        for name in runs:
                            runs[name].append(run(config, server, b, args.steps, name == "held", f"r{next(tag)}"))
                    row = {"B": b, **{name: {key: round(statistics.median(r[key] for r in rs), 1)
                                             for key in rs[0]} for name, rs in runs.items()}}
                    row["step_ratio"] = round(row["held"]["step_us"] / row["launched"]["step_us"], 3)
                    table.append(row)
                    print(row, flush=True)
        finally:
            server.close()
    doc = {"benchmark": "off_steps_v2", "config": {"steps": args.steps, "repeats": args.repeats,
                                                   "engine": "dflash (tiny)", "vllm": _vllm_version()},
           "table": table,
           "summary": {"metric": "host time of the V2 speculator's propose per off step (vLLM's V2 objects on CPU, "
                                 "dflash server), held from the launch / launched, worst over B = "
                                 f"{args.batches}",
                       "ratio": max(r["step_ratio"] for r in table), "goal": "< 1 (a proxy: issue 24's goal is "
                       "P6's speed-up >= 0.97 at acceptance length 1 on the GPU)",
                       "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}}
    emit(doc, args.out)
    return 0


def _vllm_version() -> str:
    import vllm
    return vllm.__version__


if __name__ == "__main__":
    sys.exit(main())
