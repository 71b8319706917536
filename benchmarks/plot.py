"""Redraw the benchmark plots (PNG) from the committed benchmark JSON: the one way to make them.

    pip install matplotlib            # a dev tool only: k3-accel never plots at install or run time
    python benchmarks/plot.py         # reads benchmarks/results/, writes docs/img/

Plots (an input that is missing, or lacks the needed key, is named and skipped; exit 0):

* ``draft-step-h200.png`` from ``draft-step-h200.json`` (``table``: dicts with ``engine``
  "old"/"new", ``B``, ``K``, ``context``, ``propose_ms``, ``floor_ms``, ``ratio``): draft
  step time against batch size, old and new engine, with the memory floor; K = 7, one
  panel per context length (1024, and 8192 if present).
* ``ingest-timeline-h200.png`` from ``ingest-h200.json`` key ``timeline`` (a list of
  ``{"lane": "target"|"copy"|"sender", "label", "start_us", "end_us"}``): one bar lane per
  lane.
* ``allreduce-h200x2.png`` from ``allreduce-h200x2.json`` (``rows``): all-reduce time against
  size for NCCL, the b12x DMA ring (eager and CUDA-graph replay) and the router.
* ``e2e-h200.png`` from ``e2e-h200.json`` (``summary.speedup``, and ``speedup_adaptive`` when
  present: ``{length: {B: speed-up}}``): end-to-end speed-up in vLLM against batch size, one
  line per mean acceptance length, with the goals and 1.0 marked.

Not run by CI or the tests. Not part of the installed package.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
LANES = ("target", "copy", "sender")
DRAFT_K, CONTEXTS = 7, (1024, 8192)


class Skip(Exception):
    """The input cannot be plotted; the message says why."""


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _plain_ticks(ax: Any, xs: list[float]) -> None:
    """Log axes labelled 1, 2, 4 ... (the x values) and 0.1, 0.2, 0.5, 1 ... rather than powers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.set_xticks(xs)
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())


def _title(data: dict) -> str:
    s = data.get("summary", {})
    return f"{s.get('machine', '?')}, {s.get('date', '?')}"


def draft_step(data: dict, path: Path) -> None:
    table = data.get("table")
    if not table:
        raise Skip("no 'table'")
    contexts = [c for c in CONTEXTS if any(r["K"] == DRAFT_K and r["context"] == c for r in table)]
    if not contexts:
        raise Skip(f"no rows with K = {DRAFT_K} and context in {CONTEXTS}")
    plt = _plt()
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = [r for r in table if r["K"] == DRAFT_K and r["context"] == context]
        for engine, style, color in (("old", "s-", "C1"), ("new", "o-", "C0")):
            mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["B"])
            if mine:
                ax.plot([r["B"] for r in mine], [r["propose_ms"] for r in mine], style, color=color,
                        label=f"{engine} engine")
        floor = {r["B"]: r["floor_ms"] for r in rows}
        ax.plot(sorted(floor), [floor[b] for b in sorted(floor)], "k--", label="memory floor")
        ax.set(yscale="log", xlabel="batch size B (requests per propose)",
               ylabel="draft step time (ms)", title=f"K = {DRAFT_K}, context {context}")
        ax.set_xscale("log", base=2)
        _plain_ticks(ax, sorted(floor))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"Draft server, DFlash propose step: {_title(data)}", fontsize=10)
    _save(fig, path)


def ingest_timeline(data: dict, path: Path) -> None:
    bars = data.get("timeline")
    if not bars:
        raise Skip("no 'timeline' key yet")
    lanes = [lane for lane in LANES if any(b["lane"] == lane for b in bars)]
    lanes += sorted({b["lane"] for b in bars} - set(lanes))
    t0 = min(b["start_us"] for b in bars)
    span = max(b["end_us"] for b in bars) - t0
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.8 * len(lanes)))
    for y, lane in enumerate(lanes):
        mine = [b for b in bars if b["lane"] == lane]
        ax.broken_barh([(b["start_us"] - t0, b["end_us"] - b["start_us"]) for b in mine], (y - 0.35, 0.7),
                       facecolors=f"C{y}", edgecolors="white")
        for b in mine:
            width = b["end_us"] - b["start_us"]
            text = b["label"].split(": ")[-1] if ": " in b["label"] else b["label"]
            if width < 0.04 * span:           # a sliver: say how long it took instead of naming it
                text = f"{width / 1e3:.1f} ms"
            ax.text(b["start_us"] - t0 + width / 2, y + (0.45 if width < 0.04 * span else 0), text,
                    ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(lanes)), [f"{lane}" for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (µs from the first event)")
    ax.set_title(f"Deferred ingest: target thread, copy stream, sender ({_title(data)})", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)


def allreduce(data: dict, path: Path) -> None:
    rows = data.get("rows")
    if not rows:
        raise Skip("no 'rows'")
    backend = data.get("router_decision", {}).get("backend", "?")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    x = [r["bytes"] / MiB for r in rows]
    for key, label, style, color in (
        ("nccl_ms", "NCCL, eager (= stock here)", "o-", "C0"),
        ("nccl_graph_ms", "NCCL, CUDA-graph replay", "o--", "C0"),
        ("dma_ms", "b12x DMA ring, eager", "s-", "C1"),
        ("dma_graph_ms", "b12x DMA ring, CUDA-graph replay", "s--", "C1"),
        ("router_ms", f"router, eager (auto chose {backend})", "x-", "C3"),
    ):
        if all(key in r for r in rows):
            ax.plot(x, [r[key] for r in rows], style, label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce size (MiB, bf16)")
    ax.set_ylabel("time (ms, median)")
    summary = data.get("summary", {})
    ax.set_title(f"{summary.get('machine', '?')}: best single / router >= {summary.get('ratio', float('nan')):.3f} "
                 f"(goal {summary.get('goal', '?')})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def e2e(data: dict, path: Path) -> None:
    summary = data.get("summary", {})
    adaptive = summary.get("adaptive_variant") or "adaptive"
    runs = [(name, summary.get(key) or {}) for name, key in (("K=7", "speedup"), (adaptive, "speedup_adaptive"))]
    if not any(runs[0][1].values()):
        raise Skip("no summary.speedup")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, table), style in zip(runs, ("-o", "--s")):
        for length, by_b in sorted(table.items(), key=lambda kv: float(kv[0])):
            pts = sorted((int(b), v) for b, v in by_b.items())
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], style, label=f"{name}, acceptance length {length}")
    ax.axhline(1.0, color="grey", lw=1)
    ax.plot([1, 32], [2.5, 2.0], "k:", label="goal at length 4 (B=1: 2.5, B=32: 2.0)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 8, 32])
    ax.set_xticklabels(["1", "8", "32"])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("tokens/s with remote drafting / without")
    ax.set_title(f"vLLM 0.33 V2, Qwen3-8B shape, oracle DFlash on the same GPU\n{_title(data)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


PLOTS: list[tuple[str, str, Callable[[dict, Path], None]]] = [
    ("draft-step-h200.json", "draft-step-h200.png", draft_step),
    ("ingest-h200.json", "ingest-timeline-h200.png", ingest_timeline),
    ("allreduce-h200x2.json", "allreduce-h200x2.png", allreduce),
    ("e2e-h200.json", "e2e-h200.png", e2e),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="benchmark JSON dir")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go")
    args = ap.parse_args(argv)
    try:
        _plt()
    except ImportError:
        print("plot.py needs matplotlib (a dev tool): pip install matplotlib", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for source, image, draw in PLOTS:
        src = args.results / source
        if not src.is_file():
            print(f"skipped {image}: {src} is missing")
            continue
        try:
            draw(json.loads(src.read_text()), args.out / image)
        except Skip as why:
            print(f"skipped {image}: {src}: {why}")
            continue
        print(f"wrote {args.out / image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
