"""Draw a Chrome trace written by aiopar as a timeline PNG, for the docs.

    aiopar demo --trace demo-trace.json
    python docs/_gen/timeline.py demo-trace.json docs/images/demo-timeline.png

One row per thread (or worker process), a bar per task, hatched bars where a
thread was blocked in ``wait``, and an arrow from each fork to the start of
the task it created: what Perfetto shows, as a still picture.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch


def draw(trace_path: Path, image_path: Path) -> None:
    events = json.loads(trace_path.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    order = {
        (e["pid"], e["tid"]): e["args"]["sort_index"]
        for e in events
        if e["name"] == "thread_sort_index"
    }
    rows = sorted(names, key=lambda key: order.get(key, 0))
    y = {key: i for i, key in enumerate(rows)}
    slices = [e for e in events if e["ph"] == "X"]
    tasks = sorted({e["name"] for e in slices if e["cat"] not in ("wait", "profile")})
    palette = plt.get_cmap("tab10")
    colours = {name: palette(i % 10) for i, name in enumerate(tasks)}

    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(rows)), dpi=120)
    for e, depth in _with_depth(slices):
        row = y[(e["pid"], e["tid"])]
        start, width = e["ts"] / 1000, e["dur"] / 1000
        height = 0.8 * 0.75**depth  # a nested slice sits inside its parent
        if e["cat"] == "profile":
            style = {"color": "0.93", "edgecolor": "0.8"}
        elif e["cat"] == "wait":
            style = {"color": "white", "edgecolor": "0.3", "hatch": "////", "linewidth": 0.5}
        else:
            style = {"color": colours[e["name"]], "edgecolor": "black", "linewidth": 0.4}
        ax.barh(row, width, left=start, height=height, zorder=2 + depth, **style)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    for f in (e for e in events if e["ph"] == "f"):
        s = starts[f["id"]]
        ax.annotate(
            "",
            xy=(f["ts"] / 1000, y[(f["pid"], f["tid"])]),
            xytext=(s["ts"] / 1000, y[(s["pid"], s["tid"])]),
            arrowprops={"arrowstyle": "->", "color": "0.2", "linewidth": 0.7},
            zorder=20,
        )
    ax.set_yticks(range(len(rows)), [names[key] for key in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the profile opened")
    legend = [Patch(facecolor=colours[name], edgecolor="black", label=name) for name in tasks]
    legend.append(Patch(facecolor="white", edgecolor="0.4", hatch="////", label="blocked in wait"))
    ax.legend(
        handles=legend,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(legend),
        frameon=False,
    )
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(image_path)


def _with_depth(slices: list[dict]) -> list[tuple[dict, int]]:
    """Each slice with how many slices of its row enclose it."""
    out = []
    by_row: dict[tuple[int, int], list[dict]] = {}
    for e in slices:
        by_row.setdefault((e["pid"], e["tid"]), []).append(e)
    for row in by_row.values():
        open_ends: list[float] = []
        for e in sorted(row, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            out.append((e, len(open_ends)))
            open_ends.append(e["ts"] + e["dur"])
    return out


if __name__ == "__main__":
    draw(Path(sys.argv[1]), Path(sys.argv[2]))
