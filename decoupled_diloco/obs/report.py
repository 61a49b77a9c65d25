r"""A finished run's report: `python -m decoupled_diloco.report WORKDIR` writes `WORKDIR/report.md`.

From `summary.json`, `metrics.jsonl` and (when the run recorded one) `timeline/`, it writes a
summary table and PNGs under `WORKDIR/report/`: eval loss against tokens and against wall
time, the learners' state timeline with faults marked, bytes sent against the data-parallel
equivalent, and goodput and uptime. A plot whose data the run did not record (no timeline in a
run without one, no byte counts before compression is on) is left out, and the report says so.
`experiments.compare` uses the same plot functions for several runs on one set of axes.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure  # The object API: no pyplot state, no GUI backend.

REPORT_DIR = "report"


class Run:
    """One finished run directory: its summary and its metrics events.

    Args:
      workdir: a directory holding `summary.json` (and usually `metrics.jsonl`).
      label: the name used in legends (default: the run's mode).

    Raises:
      FileNotFoundError: `workdir` has no `summary.json` (the run did not finish).
    """

    def __init__(self, workdir: str | pathlib.Path, label: str = ""):
        self.dir = pathlib.Path(workdir)
        path = self.dir / "summary.json"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: the run did not finish (or {self.dir} is not a run directory)"
            )
        self.summary: dict[str, Any] = json.loads(path.read_text())
        self.label = label or str(self.summary.get("mode", self.dir.name))
        self.events: list[dict[str, Any]] = []
        metrics = self.dir / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    self.events.append(json.loads(line))
                except json.JSONDecodeError:  # A line cut short by a crash.
                    continue

    def eval_curve(self) -> list[tuple[int, float, float]]:
        """(tokens, wall seconds, eval loss) at each evaluation, ending with the final one."""
        points = [
            (int(e.get("tokens", 0)), float(e.get("wall_s", 0.0)), float(e["eval_loss"]))
            for e in self.events
            if finite(e.get("eval_loss"))
        ]
        final, tokens = self.summary.get("final_eval_loss"), self.summary.get("tokens", 0)
        if finite(final) and (not points or points[-1][0] < tokens):
            wall = self.summary.get("train_wall_s") or self.summary.get("wall_s", 0.0)
            points.append((int(tokens), float(wall), float(final)))
        return points

    def goodput(self) -> dict[str, Any] | None:
        """The summary's goodput accounting as a dict with `goodput` (and more), if recorded."""
        s, value = self.summary, self.summary.get("goodput")
        if finite(value):
            out = {"goodput": float(value), "uptime": s.get("uptime")}
            out.update(
                {k: s[k] for k in ("lost_steps", "failures_injected", "recoveries") if k in s}
            )
            return out
        return value if isinstance(value, dict) and "goodput" in value else None

    def time_by_state(self) -> dict[str, dict[str, float]] | None:
        """{learner: {state: seconds}} from the summary's timeline accounting, if recorded."""
        learners = (self.summary.get("timeline") or {}).get("learners")
        if not isinstance(learners, dict) or not learners:
            return None
        return {str(k): dict(v.get("by_state", {})) for k, v in learners.items()}

    def bytes_sent(self) -> tuple[float, float] | None:
        """(bytes sent, data-parallel equivalent) if the run counted them."""
        sent = _total(self.summary.get("bytes_sent"))
        dp = _total(self.summary.get("dp_equivalent_bytes"))
        return (sent, dp) if sent is not None and dp else None


def finite(x: Any) -> bool:
    """Whether `x` is a finite int or float (not a bool, None, NaN or a string)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _total(x: Any) -> float | None:
    """A byte count given as a number or as a dict of numbers (e.g. per direction)."""
    if finite(x):
        return float(x)
    if isinstance(x, dict):
        values = [v for v in x.values() if finite(v)]
        return float(sum(values)) if values else None
    return None


# Plots (each takes one or more runs and writes one PNG) -------------------------------------


def plot_eval(runs: Sequence[Run], x: str, path: pathlib.Path) -> bool:
    """Eval loss against `x` ("tokens" or "wall") for every run that evaluated; False if none."""
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    drawn = False
    for run in runs:
        curve = run.eval_curve()
        if curve:
            xs = [p[0] if x == "tokens" else p[1] for p in curve]
            ax.plot(xs, [p[2] for p in curve], marker="o", markersize=3, label=run.label)
            drawn = True
    if not drawn:
        return False
    ax.set_xlabel("training tokens (all learners)" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(f"Eval loss vs {'tokens' if x == 'tokens' else 'wall time'}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    return True


def plot_bars(
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    title: str,
    ylabel: str,
    path: Any,
    log: bool = False,
) -> None:
    """Grouped bars: one group per label, one bar per series (e.g. goodput and uptime)."""
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width=width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    if log:  # Byte counts differ by orders of magnitude.
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.savefig(path, dpi=110)


def plot_time_by_state(
    by_state: dict[str, dict[str, float]], title: str, path: pathlib.Path
) -> None:
    """One stacked bar per learner: seconds spent in each state (stepping is productive)."""
    fig = Figure(figsize=(8.0, 1.2 + 0.5 * len(by_state)), layout="constrained")
    ax = fig.add_subplot()
    from decoupled_diloco.obs.timeline import STATES
    from decoupled_diloco.obs.timeline_plot import COLORS

    # Stepping (productive) first, then the rest in the timeline's order.
    order = ["stepping"] + [x for x in STATES if x != "stepping"]
    states = [x for x in order if any(x in v for v in by_state.values()) and x != "done"]
    learners = sorted(by_state, key=lambda k: int(k) if k.isdigit() else k)
    left = [0.0] * len(learners)
    for state in states:
        widths = [by_state[k].get(state, 0.0) for k in learners]
        ax.barh(
            range(len(learners)), widths, left=left, color=COLORS.get(state, "#dddddd"), label=state
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(range(len(learners)), [f"learner {k}" for k in learners])
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(path, dpi=110)


# The report -----------------------------------------------------------------------------------


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """(name, value) rows of the summary table; rows the run did not record are left out."""
    s = run.summary
    rows = [
        ("mode", str(s.get("mode"))),
        ("learners", str(s.get("num_learners"))),
        ("inner steps H", str(s.get("inner_steps"))),
        ("steps done", f"{s.get('steps_done')} of {s.get('train_steps')}"),
        ("training tokens", f"{s.get('tokens', 0):,}"),
        ("wall time", f"{s.get('wall_s', 0):.1f} s"),
        ("final eval loss", _fmt(s.get("final_eval_loss"), ".4f")),
        ("final train loss", _fmt(s.get("final_train_loss"), ".4f")),
        ("outer syncs (merges)", str(s.get("outer_syncs"))),
        ("parameters", f"{s.get('params', 0):,}"),
    ]
    if "final_eval_bpb" in s:  # (token data whose bytes are known: `data.heldout`)
        rows.insert(7, ("final eval bits per byte", _fmt(s["final_eval_bpb"], ".4f")))
    if "stall_fraction_max" in s:
        rows.append(("largest learner stall", f"{100 * s['stall_fraction_max']:.2f}%"))
    goodput = run.goodput()
    if goodput:
        rows.append(("goodput", _fmt(goodput.get("goodput"), ".3f")))
        if goodput.get("uptime") is not None:
            rows.append(("uptime", _fmt(goodput.get("uptime"), ".3f")))
        for key in ("lost_steps", "failures_injected", "recoveries"):
            if key in goodput:
                rows.append((key.replace("_", " "), str(goodput[key])))
    sent = run.bytes_sent()
    if sent:
        rows.append(("bytes sent", f"{sent[0]:,.0f}"))
        rows.append(("data-parallel equivalent", f"{sent[1]:,.0f} ({sent[1] / sent[0]:.1f}x)"))
    return rows


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if finite(x) else "-"


def _timeline_png(workdir: pathlib.Path, out: pathlib.Path) -> bool:
    """Draws the learners' states with faults and recoveries marked, if the run recorded them."""
    if not any((workdir / "timeline").glob("*.jsonl")):
        return False
    from decoupled_diloco.obs import timeline_plot

    timeline_plot.plot_timeline(workdir, out)
    return True


def write_report(workdir: str | pathlib.Path) -> pathlib.Path:
    """Writes `workdir/report.md` and its PNGs (in `workdir/report/`); returns the report path."""
    run = Run(workdir)
    out = run.dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    lines = [f"# Run report: {run.summary.get('mode')} ({run.dir.name})", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in summary_rows(run)] + [""]
    missing = []
    lines += ["## Eval loss", ""]
    if plot_eval([run], "tokens", out / "eval_loss_tokens.png"):
        plot_eval([run], "wall", out / "eval_loss_wall.png")
        lines += [f"![eval loss vs tokens]({REPORT_DIR}/eval_loss_tokens.png)", ""]
        lines += [f"![eval loss vs wall time]({REPORT_DIR}/eval_loss_wall.png)", ""]
    else:
        missing.append("eval loss (the run never evaluated)")
    if _timeline_png(run.dir, out / "timeline.png"):
        lines += ["## Learner timeline", "", f"![learner states]({REPORT_DIR}/timeline.png)", ""]
    else:
        missing.append("learner timeline (no `timeline/` recorded)")
    goodput, by_state = run.goodput(), run.time_by_state()
    if goodput:
        uptime = _fmt(goodput.get("uptime"), ".3f")
        title = f"goodput {_fmt(goodput['goodput'], '.3f')}, uptime {uptime}"
        if by_state:
            plot_time_by_state(by_state, f"Time by state: {title}", out / "goodput.png")
        else:
            series = {"goodput": [goodput["goodput"]]}
            if finite(goodput.get("uptime")):
                series["uptime"] = [goodput["uptime"]]
            plot_bars([run.label], series, title, "fraction", out / "goodput.png")
        lines += ["## Goodput and uptime", "", f"![goodput]({REPORT_DIR}/goodput.png)", ""]
    else:
        missing.append("goodput and uptime (not in summary.json)")
    sent = run.bytes_sent()
    if sent:
        labels = [run.label, "data-parallel equivalent"]
        title = f"Bytes sent: {sent[1] / sent[0]:.1f}x less than data-parallel"
        plot_bars(labels, {"bytes": list(sent)}, title, "bytes", out / "bytes.png", log=True)
        lines += ["## Communication", "", f"![bytes sent]({REPORT_DIR}/bytes.png)", ""]
    else:
        missing.append("bytes sent vs data-parallel (not in summary.json)")
    if missing:
        lines += ["Not recorded by this run: " + "; ".join(missing) + ".", ""]
    lines += [
        "## Files",
        "",
        "- `summary.json`: the numbers above and the full config",
        "- `metrics.jsonl`: one JSON object per log event",
        "- `tb/`: TensorBoard event files (`pip install tensorboard; tensorboard --logdir "
        f"{run.dir}/tb`)",
    ]
    if (run.dir / "logs").is_dir():
        lines.append("- `logs/`: each process's output")
    path = run.dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _python() -> str:
    """How the user ran Python: `.venv/bin/python` from the repository, else `python`."""
    exe = pathlib.Path(sys.executable)
    try:
        return str(exe.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return "python"


def next_steps(config: Any, report: pathlib.Path, config_file: str = "") -> str:
    """The closing lines of a training command: where the report is, and what to try next."""
    py, workdir = _python(), report.parent
    config_file = config_file or "experiments/configs/tiny_lm.py"
    lines = [
        f"Report: {report} (plots in {workdir / REPORT_DIR}/)",
        "Next:",
        *(
            [
                "  text from the model it trained (its final global model, kept in "
                f"{workdir / 'model'}/):",
                f'    {py} -m decoupled_diloco.sample --workdir={workdir} --prompt="def "',
            ]
            if (workdir / "model" / "model.json").exists()
            and getattr(getattr(config, "data", None), "dataset", "text") == "text"
            else []
        ),
        "  compare dp, diloco and decoupled on the same data, seed and token budget:",
        f"    {py} -m experiments.compare --config={config_file} --workdir=runs/compare",
    ]
    if config.mode != "decoupled":
        lines += [
            "  the asynchronous mode (a syncer and learner processes):",
            f"    {py} -m experiments.train --config=experiments/configs/tiny_lm_decoupled.py "
            "--workdir=runs/dec",
        ]
    else:
        lines += [
            "  watch the next decoupled run live, from another terminal while it trains:",
            f"    {py} -m decoupled_diloco.status --workdir={workdir} --watch",
        ]
    writers = getattr(getattr(config, "metrics", None), "writers", "tensorboard")
    if "tensorboard" in writers:
        lines.append(
            f"  TensorBoard: pip install tensorboard && tensorboard --logdir {workdir / 'tb'}"
        )
    if "wandb" in writers and config.metrics.wandb_mode == "offline":
        lines.append(f"  W&B (offline): wandb sync {workdir / 'wandb'}/offline-run-*")
    lines.append("  every option: docs/config_reference.md; the ideas: docs/concepts.md")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """`python -m decoupled_diloco.report WORKDIR [WORKDIR ...]`."""
    if len(argv) < 2:
        print(__doc__.splitlines()[0].split(": ", 1)[1], file=sys.stderr)
        return 2
    for workdir in argv[1:]:
        try:
            print(f"wrote {write_report(workdir)}")
        except FileNotFoundError as error:
            print(error, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
