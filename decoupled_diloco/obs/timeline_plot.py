"""Pictures of a run's resilience: learner states over time with faults, and goodput by mode.

`plot_timeline` draws each learner's states with the faults marked; `plot_goodput` puts the
goodput and uptime of several runs (modes) side by side.

  python -m decoupled_diloco.obs.timeline_plot --workdir=runs/chaos  # runs/chaos/timeline.png
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

from decoupled_diloco.obs import timeline as timeline_lib

COLORS = {
    "starting": "#b0b0b0",
    "restoring": "#8c6bb1",
    "waiting": "#fdd0a2",
    "compiling": "#6baed6",
    "stepping": "#31a354",
    "blocked": "#fd8d3c",
    "checkpointing": "#3182bd",
    "evaluating": "#9e9ac8",
    "paused": "#fb6a4a",
    "down": "#252525",
}


def _events(workdir: pathlib.Path) -> list[dict[str, Any]]:
    path = workdir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") in ("fault", "recovery"):
            out.append(event)
    return out


def plot_timeline(
    workdir: str | pathlib.Path, out: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Draws every learner's states (one row each) and the faults; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = pathlib.Path(workdir)
    out = pathlib.Path(out) if out else workdir / "timeline.png"
    timelines = timeline_lib.load(workdir / "timeline")
    if not timelines:
        raise FileNotFoundError(f"no timeline records under {workdir / 'timeline'}")
    t0 = min(r[0].t for r in timelines.values() if r)
    t_end = max(r[-1].t for r in timelines.values() if r)
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(timelines) + 1.8))
    seen = set()
    row_of = {learner: row for row, learner in enumerate(sorted(timelines))}
    for learner, records in sorted(timelines.items()):
        row = row_of[learner]
        for start, end, record in timeline_lib.intervals(records, t_end):
            if end <= start or record.state == "done":
                continue
            label = record.state if record.state not in seen else None
            seen.add(record.state)
            ax.broken_barh(
                [(start - t0, end - start)],
                (row - 0.4, 0.8),
                facecolors=COLORS.get(record.state, "#dddddd"),
                label=label,
            )
    for event in _events(workdir):
        x = event["time"] - t0
        # A syncer fault concerns every learner (its `learner` only names whose step it awaited).
        learner = None if event.get("kind") == "kill_syncer" else event.get("learner")
        if learner is None and len(event.get("learners") or []) == 1:  # a learner's restart
            learner = event["learners"][0]
        rows = (
            [row_of[learner]]
            if isinstance(learner, int) and learner in row_of
            else list(row_of.values())
        )
        fault = event["event"] == "fault"
        for row in rows:
            ax.plot(
                x,
                row + 0.45,
                marker="v" if fault else "^",
                color="#de2d26" if fault else "#2b8cbe",
                markersize=8,
                linestyle="none",
            )
        if fault:
            ax.annotate(
                event.get("kind", ""),
                (x, max(rows) + 0.5),
                fontsize=7,
                ha="center",
                va="bottom",
                color="#de2d26",
            )
    ax.set_yticks(range(len(timelines)), [f"learner {k}" for k in sorted(timelines)])
    ax.set_xlabel("wall time (s)")
    ax.set_ylim(-0.6, len(timelines) - 0.1 + 0.5)
    result = timeline_lib.analyze(timelines)
    ax.set_title(
        f"learner states (▼ fault, ▲ recovery) — goodput {result.goodput:.2f}, "
        f"uptime {result.uptime:.2f}, lost steps {result.lost_steps}"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_goodput(runs: Mapping[str, Mapping[str, Any]], out: str | pathlib.Path) -> pathlib.Path:
    """Bars of goodput and uptime per run (e.g. per mode, from their summaries)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.6))
    width = 0.38
    for k, (key, color) in enumerate((("goodput", "#31a354"), ("uptime", "#6baed6"))):
        values = [float(runs[n].get(key) or 0.0) for n in names]
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        bars = ax.bar(xs, values, width, label=key, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("share")
    ax.set_title("goodput and uptime under the same fault schedule")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> None:
    """Writes WORKDIR/timeline.png."""
    del argv
    from absl import flags

    print(plot_timeline(flags.FLAGS.workdir))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("workdir", "", "A run's directory (with timeline/ and metrics.jsonl).")
    app.run(main)
