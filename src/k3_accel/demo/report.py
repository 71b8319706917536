"""The demo's text report, from a scenario result: what a CPU run shows, what it cannot, timings."""
from __future__ import annotations

CLIENT_PHASES = ("stage", "d2h", "enqueue", "wait", "round_trip", "step")
MAIN = ("long prompt", "prompts")          # the rounds acceptance and speed are read from
SPEED = ("  These timings say nothing about speed-ups: the target here is a tiny model on a CPU, where\n"
         "  a step is cheap and not memory-bound, and the draft server shares the same cores. Drafting\n"
         "  pays off when the target is a large model on a GPU, where a step is memory-bound (checking\n"
         "  K+1 tokens costs about as much as one) and the draft runs on its own device; what was\n"
         "  measured on GPUs: docs/benchmarks.md.")
CHECKPOINTS = {
    "trained": "tiny, built here: a 4-layer Qwen3 target trained {target_s} on a built-in paragraph, "
               "a DFlash draft distilled from it{draft}",
    "untrained": "tiny random target and draft (--untrained): every code path runs, the draft "
                 "guesses almost nothing",
}


def _runs(result: dict) -> dict[str, dict]:
    return {r["name"]: r for r in result["runs"]}


def _ms(phases: dict, name: str) -> str:
    entry = phases.get(name)
    return f"{name} {entry['mean_ms']:.2f} ms" if entry else f"{name} -"


def _pick(rounds: list[dict], labels: tuple[str, ...]) -> list[dict]:
    picked = [r for r in rounds if r.get("label") in labels]
    return picked or rounds


def merge_rounds(rounds: list[dict]) -> dict:
    """Rounds as one: outputs concatenated, counters summed, the last round's stats."""
    last = rounds[-1]
    spec = {k: sum(r["spec"][k] for r in rounds) for k in last["spec"]}
    width = max((len(r.get("accepted_per_pos") or []) for r in rounds), default=0)
    per_pos = [sum((r.get("accepted_per_pos") or [0] * width)[i] for r in rounds) for i in range(width)]
    return {"outputs": [o for r in rounds for o in r["outputs"]], "spec": spec, "accepted_per_pos": per_pos,
            "generate_s": sum(r["generate_s"] for r in rounds), "steps": sum(r["steps"] for r in rounds),
            "client": last.get("client"), "server": last.get("server")}


def _counter(rnd: dict | None, name: str) -> int:
    return ((rnd or {}).get("client") or {}).get("counters", {}).get(name, 0)


def _acceptance(merged: dict, untrained: bool) -> str:
    spec = merged["spec"]
    drafted, accepted, drafts = spec["draft_tokens"], spec["accepted"], spec.get("drafts", 0)
    if not drafted:
        return "NO: no draft tokens were proposed"
    line = (f"{'yes' if accepted else 'NO'}: {accepted} of {drafted} draft tokens ({accepted / drafted:.1%})")
    if drafts:
        k = drafted / drafts
        per_pos = " ".join(f"{a / drafts:.0%}" for a in merged["accepted_per_pos"])
        line += (f"; {accepted / drafts:.2f} of {k:.0f} accepted per step ({1 + accepted / drafts:.2f} tokens "
                 f"per target step)" + (f"; by draft position: {per_pos}" if per_pos else ""))
    if untrained:
        line += " (random draft: expected)"
    return line


def _fail_closed(rounds: dict[str, dict], before: dict | None) -> str:
    crash, recovered = rounds.get("crash"), rounds.get("recovered")
    if crash is None or recovered is None:
        return "not run"
    disabled = _counter(crash, "disabled_requests") - _counter(before, "disabled_requests")
    restarts = _counter(recovered, "server_restarts") - _counter(before, "server_restarts")
    proposals = ((recovered.get("server") or {}).get("ops") or {}).get("propose", 0)
    ok = disabled > 0 and proposals > 0
    return (f"{'yes' if ok else 'NOT SEEN'}: the draft server was SIGKILLed mid-round: {disabled} requests went "
            f"on without drafts, outputs unchanged; restarted on the same port (client saw {restarts} "
            f"restart), it answered {proposals} proposals for new requests, {recovered['spec']['accepted']} "
            "draft tokens accepted")


def _controller(client: dict) -> str:
    """What the per-step K controller decided (requests' drafts per step, how often it was off)."""
    c = client.get("controller")
    if not c:
        return "fixed K (this demo's default on a CPU; --adaptive lets the per-step controller choose)"
    hist = {int(k): n for k, n in (c.get("k_chosen") or {}).items()}
    total = sum(hist.values()) or 1
    spread = " ".join(f"K={k}: {n / total:.0%}" for k, n in sorted(hist.items()) if n)
    rt, step = c.get("round_trip_ms"), c["step_ms"]
    drafting = step.get("fixed_with_drafts")
    return (f"chosen per request and step by the controller ({spread or 'no steps'}); speculation off for "
            f"{c.get('off_steps', 0)} steps, {c.get('probe_steps', 0)} probes; measured: target step "
            f"{step['fixed']:.2f} ms + {step['per_token'] * 1e3:.1f} us/token"
            f"{'' if drafting is None else f' ({drafting:.2f} ms + the same per token with drafts to verify)'}, "
            f"draft round trip {'-' if rt is None else f'{rt:.2f} ms'}")


def _checkpoints(result: dict, tiny: str | None) -> str:
    if tiny is None:
        return "your checkpoints"
    build = result.get("build", {})
    target, draft = build.get("target", {}), build.get("draft")
    draft_text = "" if not draft else (f" in {draft['total_s']:.0f} s (held-out acceptance at "
                                       f"K={draft['settings']['k']}: {draft['acceptance']:.0%})")
    return CHECKPOINTS[tiny].format(target_s=f"in {target.get('train_s', 0):.0f} s", draft=draft_text)


def format_report(result: dict, engine: str, tiny: str | None, workdir: str | None = None) -> str:
    """``tiny``: "trained", "untrained" or None (the user's checkpoints)."""
    runs = _runs(result)
    w_rounds, wo_rounds = runs["with"]["rounds"], runs["without"]["rounds"]
    without, with_ = merge_rounds(_pick(wo_rounds, MAIN)), merge_rounds(_pick(w_rounds, MAIN))
    all_same = [r["outputs"] for r in w_rounds] == [r["outputs"] for r in wo_rounds]
    by_label = {r.get("label"): r for r in w_rounds}
    main = _pick(w_rounds, MAIN)
    client, server = main[-1].get("client") or {}, main[-1].get("server") or {}
    ops, srv = server.get("ops", {}), result.get("server", {})
    prompts = sum(len(r["outputs"]) for r in w_rounds)
    tokens = sum(len(o) for r in w_rounds for o in r["outputs"])
    deferred = client.get("counters", {}).get("deferred_ingests", 0)
    spec = with_["spec"]
    per_step = f"{spec['accepted'] / spec['drafts']:.2f}" if spec.get("drafts") else "-"
    lines = [
        f"k3-accel demo: remote drafting, {engine} engine",
        f"  checkpoints: {_checkpoints(result, tiny)}",
        "",
        "What this CPU run shows",
        f"  identical outputs  {'yes' if all_same else 'NO'}: {prompts} prompts in {len(w_rounds)} rounds, {tokens} "
        "tokens, the same with and without remote drafting (greedy)",
        f"  drafts accepted    {_acceptance(with_, tiny == 'untrained')}",
        f"  deferred ingest    {'yes' if deferred else 'NOT SEEN'}: {deferred} prefill chunks of the long prompt "
        "went to the draft server without the target waiting for it",
        f"  fails closed       {_fail_closed(by_label, main[-1])}",
        f"  speculation K      {_controller(client)}",
        f"  draft server       {ops.get('propose', 0)} propose and {ops.get('ingest', 0)} ingest messages, "
        f"{server.get('ingested_rows', 0)} context rows, {server.get('tokens_proposed', 0)} draft tokens "
        f"(before the crash); its Prometheus metrics were at {srv.get('metrics_url', '-')}",
        "",
        "What it cannot show: speed",
        f"  generation         {without['generate_s']:.2f} s without, {with_['generate_s']:.2f} s with "
        f"({without['steps']} vs {with_['steps']} target steps for the same tokens)",
        f"  per step           {per_step} draft tokens accepted; client means: "
        + ", ".join(_ms(client.get("phases", {}), p) for p in CLIENT_PHASES),
        SPEED,
        "",
        "Timings",
        f"  build checkpoints  {result.get('build_s', 0):.1f} s",
        f"  draft server start {srv.get('start_s', 0):.1f} s",
        f"  engine start       {runs['without']['start_s']:.1f} s without, {runs['with']['start_s']:.1f} s with",
        f"  files kept in {workdir}" if workdir else "  temp files removed (--keep keeps them)",
    ]
    return "\n".join(lines) + "\n"
