"""Draw a run's trace as a waterfall (docs/img/trace-waterfall.png) from the spans tests/test_tracing.py collected:

    UNWIND_TRACE_DUMP=/tmp/trace.json DATABASE_URL=postgres://... .venv/bin/python -m pytest \
        tests/test_tracing.py -k joins
    .venv/bin/python -m bench.waterfall /tmp/trace.json docs/img/trace-waterfall.png

Needs matplotlib (the bench extra).
"""
from __future__ import annotations

import json
import sys

COLOURS = {"server": "#4c78a8", "forward": "#54a24b", "compensation": "#e45756", "other": "#9d9d9d"}


def rows(spans: list[dict]) -> list[tuple[int, dict]]:
    """Spans depth-first under their parents, each with its depth (the agent's own span is not in the dump)."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict]] = {}
    for span in spans:
        parent = span["parent_span_id"] if span["parent_span_id"] in ids else ""
        children.setdefault(parent, []).append(span)
    ordered: list[tuple[int, dict]] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["start"]):
            ordered.append((depth, span))
            walk(span["span_id"], depth + 1)
    walk("", 0)
    return ordered


def colour(span: dict) -> str:
    if span["kind"] == 2:
        return COLOURS["server"]
    return COLOURS.get(span["attributes"].get("unwind.action.kind"), COLOURS["other"])


def label(span: dict) -> str:
    a = span["attributes"]
    if "unwind.action.id" in a and a.get("gen_ai.operation.name"):
        return f'{span["name"]}  action {a["unwind.action.id"]} attempt {a["unwind.attempt"]}: {a["unwind.outcome"]}'
    return span["name"]


def draw(spans: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = rows(spans)
    t0 = min(s["start"] for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(ordered) + 1.2))
    by_id = {s["span_id"]: i for i, (_, s) in enumerate(ordered)}
    for i, (depth, span) in enumerate(ordered):
        start, width = (span["start"] - t0) / 1e6, max((span["end"] - span["start"]) / 1e6, 0.5)
        ax.barh(i, width, left=start, color=colour(span), height=0.6)
        ax.text(start + width + 20, i, "  " * depth + label(span), va="center", fontsize=8)
        for _, linked in span["links"]:
            if linked in by_id:  # a compensation's link to the attempt it undoes
                j = by_id[linked]
                other = ordered[j][1]
                ax.annotate("", xy=((other["end"] - t0) / 1e6, j), xytext=(start, i),
                            arrowprops={"arrowstyle": "->", "color": COLOURS["compensation"], "lw": 0.8, "ls": "--"})
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first span")
    ax.set_title("One agent run in its own trace: requests, steps (green), "
                 "compensations (red, linked to what they undo)", fontsize=9)
    ax.set_xlim(0, (max(s["end"] for s in spans) - t0) / 1e6 * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(json.loads(open(sys.argv[1]).read()), sys.argv[2])
