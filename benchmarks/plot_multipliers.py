"""Plot the multipliers a `snoop_echo_bench.py --json` run measured, one panel per model and batch.

    python benchmarks/plot_multipliers.py results.json [more.json ...] docs/img/multipliers.png

Bars are each mode's median time over its baseline's (plain eager for eager modes, plain
`torch.compile` for compiled ones); dashed lines mark the goals. Failed modes are drawn as a hatched
"failed" bar, never as a number.
"""

from __future__ import annotations

import json
import sys

GOALS = {"narrate": 1.15, "exact": 2.0, "fused": 1.05, "fused_dynamic": 1.15, "fused_exact": 1.5}


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 5.2), sharey=True, squeeze=False)
    for ax, result in zip(axes[0], results):
        rows = [row for row in result["modes"] if row["baseline"]]
        names = [row["mode"] for row in rows]
        values = [row["multiplier"] if row["multiplier"] is not None else 0.0 for row in rows]
        colors = ["tab:blue" if row["baseline"] == "eager" else "tab:orange" for row in rows]
        bars = ax.barh(names, values, color=colors)
        for bar, row in zip(bars, rows):
            if row["error"]:
                bar.set_hatch("//")
                ax.text(0.05, bar.get_y() + bar.get_height() / 2, "failed", va="center", fontsize=8)
            else:
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {row['multiplier']:.2f}x",
                        va="center", fontsize=8)
        for index, row in enumerate(rows):
            goal = GOALS.get(row["mode"])
            if goal:
                ax.plot([goal, goal], [index - 0.4, index + 0.4], "k--", linewidth=1)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{result['model']}, batch {result['batch']} ({result['device']})", fontsize=10)
        ax.set_xlabel("time / baseline (log scale)")
        ax.invert_yaxis()
    env = report["environment"]
    fig.suptitle(f"torchlens multipliers — torch {env['torch']}, {env['cpu_count']} CPUs "
                 f"(blue: vs plain eager, orange: vs plain torch.compile; dashes: goals)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = argv or sys.argv[1:]
    if len(argv) < 2:
        print(__doc__)
        return 2
    reports = []
    for path in argv[:-1]:  # runs of several models (same machine) are drawn side by side
        with open(path) as f:
            reports.append(json.load(f))
    merged = dict(reports[0], results=[result for report in reports for result in report["results"]])
    plot(merged, argv[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
