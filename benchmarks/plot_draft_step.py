"""Plot draft_step.py's table: propose time against batch, old engine vs new, with floors.

Usage: python benchmarks/plot_draft_step.py benchmarks/results/draft-step-h200.json [out.png]
(needs matplotlib).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    doc = json.loads(src.read_text())
    table, summary = doc["table"], doc["summary"]
    fig, ax = plt.subplots(figsize=(8, 5))
    series = [("old", 7, 1024, "s-", "C3", "old engine (eager, per request), K=7, ctx 1024"),
              ("new", 7, 1024, "o-", "C0", "new engine, K=7, ctx 1024"),
              ("new", 15, 1024, "o--", "C0", "new engine, K=15, ctx 1024"),
              ("new", 7, 8192, "^-", "C2", "new engine, K=7, ctx 8192"),
              ("new", 15, 8192, "^--", "C2", "new engine, K=15, ctx 8192")]
    for engine, k, ctx, style, color, label in series:
        rows = sorted((r for r in table if (r["engine"], r["K"], r["context"]) == (engine, k, ctx)),
                      key=lambda r: r["B"])
        if rows:
            ax.plot([r["B"] for r in rows], [r["propose_ms"] for r in rows], style, color=color,
                    label=label)
    for ctx, color in ((1024, "C0"), (8192, "C2")):
        rows = sorted((r for r in table if (r["engine"], r["K"], r["context"]) == ("new", 7, ctx)),
                      key=lambda r: r["B"])
        ax.plot([r["B"] for r in rows], [r["floor_ms"] for r in rows], ":", color=color,
                label=f"floor (bytes / copy bandwidth), ctx {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests per propose (B)")
    ax.set_ylabel("propose step (ms, median wall time)")
    ax.set_title(f"{summary['machine']}: worst new/floor at K=7, ctx 1024, B<=32 = "
                 f"{summary['ratio']:.2f} (goal {summary['goal']})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
