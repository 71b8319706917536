"""The demo's short text report, from a scenario result."""
from __future__ import annotations

CLIENT_PHASES = ("stage", "d2h", "enqueue", "wait", "round_trip", "step")


def _runs(result: dict) -> dict[str, dict]:
    return {r["name"]: r for r in result["runs"]}


def _ms(phases: dict, name: str) -> str:
    entry = phases.get(name)
    return f"{name} {entry['mean_ms']:.2f} ms" if entry else f"{name} -"


def merge_rounds(rounds: list[dict]) -> dict:
    """One run's rounds as one: outputs concatenated, counters summed, the last stats."""
    last = rounds[-1]
    return {"outputs": [o for r in rounds for o in r["outputs"]],
            "spec": {k: sum(r["spec"][k] for r in rounds) for k in last["spec"]},
            "generate_s": sum(r["generate_s"] for r in rounds), "steps": sum(r["steps"] for r in rounds),
            "client": last.get("client"), "server": last.get("server")}


def format_report(result: dict, engine: str, tiny: bool, workdir: str | None = None) -> str:
    runs = _runs(result)
    without, with_ = merge_rounds(runs["without"]["rounds"]), merge_rounds(runs["with"]["rounds"])
    same = with_["outputs"] == without["outputs"]
    tokens = sum(len(o) for o in with_["outputs"])
    spec, client, server = with_["spec"], with_.get("client") or {}, with_.get("server") or {}
    counters, ops = client.get("counters", {}), server.get("ops", {})
    rate = spec["accepted"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0
    srv = result.get("server", {})
    lines = [
        f"k3-accel demo: remote drafting, {engine} engine ({'tiny random checkpoints' if tiny else 'your checkpoints'})",
        f"  outputs identical with and without remote drafting: {'yes' if same else 'NO'} "
        f"({len(with_['outputs'])} prompts, {tokens} tokens each way)",
        f"  drafts (vLLM): {spec['draft_tokens']} draft tokens proposed, {spec['accepted']} accepted ({rate:.1%})",
        f"  draft server: {ops.get('propose', 0)} propose, {ops.get('ingest', 0)} ingest messages, "
        f"{server.get('ingested_rows', 0)} context rows, {server.get('tokens_proposed', 0)} draft tokens",
        f"  deferred ingests (chunked prefill, no wait for the server): {counters.get('deferred_ingests', 0)}",
        "  timings:",
        f"    build checkpoints  {result.get('build_s', 0):.1f} s",
        f"    draft server start {srv.get('start_s', 0):.1f} s",
        f"    engine start       {runs['without']['start_s']:.1f} s without, {runs['with']['start_s']:.1f} s with",
        f"    generation         {without['generate_s']:.2f} s without, {with_['generate_s']:.2f} s with "
        f"({with_['steps']} vs {without['steps']} engine steps)",
        "    per step, client means: " + ", ".join(_ms(client.get("phases", {}), p) for p in CLIENT_PHASES),
        f"  the draft server's Prometheus metrics were at {srv.get('metrics_url', '-')} "
        "(it stopped with the demo)",
    ]
    if tiny and engine == "dflash":
        lines.append("  note: a random tiny draft guesses almost nothing right; try --engine ngram, "
                     "or --target/--draft with real checkpoints")
    lines.append(f"  files kept in {workdir}" if workdir else "  temp files removed (--keep keeps them)")
    return "\n".join(lines) + "\n"
