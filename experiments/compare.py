r"""Runs dp, diloco and decoupled side by side and compares them in one table and one set of plots.

  python -m experiments.compare --config=experiments/configs/tiny_lm.py --workdir=runs/compare
  python -m experiments.compare --config=... --config.train_steps=100 --modes=diloco,decoupled

Every mode trains the same config (same data, seed, learners, inner steps and token budget; the
same chaos schedule when the config has one) with only `mode` changed, each as its own
`python -m experiments.train` process in `WORKDIR/MODE` (with its own report). Then
`WORKDIR/comparison.md` gets one table (final eval loss and its ratio to dp, tokens, wall time,
outer syncs, goodput, uptime, bytes sent) and `WORKDIR/comparison/` the plots: eval loss vs
tokens and vs wall time, wall time, goodput and uptime, bytes sent. A mode whose
`WORKDIR/MODE` already holds a finished run of the same config is not trained again
(`--rerun` forces it), so adding a mode or re-plotting is cheap.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from decoupled_diloco import config as config_lib
from decoupled_diloco.local.runs import finished
from decoupled_diloco.obs.report import finite

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/tiny_lm.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Directory for all runs and the table.")
_MODES = flags.DEFINE_list("modes", list(config_lib.MODES), "Modes to run, in order.")
_RERUN = flags.DEFINE_bool(
    "rerun", False, "Train again even where WORKDIR/MODE holds a finished run of the same config."
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_mode(config_file: pathlib.Path, mode: str, workdir: pathlib.Path) -> None:
    """Trains one mode in its own process (as a user would); raises if it fails."""
    command = [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config={config_file}",
        f"--config.mode={mode}",
        f"--workdir={workdir}",
        "--nohints",  # compare prints its own closing lines
    ]
    print(f"[compare] {mode}: {' '.join(command[1:])}", flush=True)
    result = subprocess.run(command, cwd=ROOT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the {mode} run failed (exit {result.returncode}); see above")


def _cell(x: object, spec: str) -> str:
    return format(x, spec) if finite(x) else "-"


def write_comparison(workdir: pathlib.Path, modes: Sequence[str]) -> pathlib.Path:
    """Writes `workdir/comparison.md` and `workdir/comparison/*.png` from the finished runs."""
    from decoupled_diloco.obs.report import Run, plot_bars, plot_eval

    runs = [Run(workdir / mode, label=mode) for mode in modes]
    out = workdir / "comparison"
    out.mkdir(parents=True, exist_ok=True)
    dp = next((r for r in runs if r.summary.get("mode") == "dp"), None)
    dp_loss = dp.summary.get("final_eval_loss") if dp else None
    header = (
        "| mode | final eval loss | vs dp | tokens | wall time (s) | outer syncs | goodput | "
        "uptime | bytes sent | dp-equivalent bytes |"
    )
    lines = [
        f"# Comparison ({workdir.name})",
        "",
        "Same config, data, seed and token budget; only `mode` differs. Each run's own report is "
        "in `MODE/report.md`. Wall time is `wall_s` of each summary (data loading, process "
        "start-up and compilation included); in the eval-vs-wall-time plot, `dp` and `diloco` "
        "count from the start of their training loop and `decoupled` from the launch of its "
        "processes.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for run in runs:
        s, goodput, sent = run.summary, run.goodput() or {}, run.bytes_sent()
        loss = s.get("final_eval_loss")
        ratio = loss / dp_loss if dp_loss and isinstance(loss, float) else None
        lines.append(
            f"| {run.label} | {_cell(loss, '.4f')} | {_cell(ratio, '.3f')}{'x' * finite(ratio)} | "
            f"{s.get('tokens', 0):,} | {_cell(s.get('wall_s'), '.1f')} | "
            f"{s.get('outer_syncs', '-')} | {_cell(goodput.get('goodput'), '.3f')} | "
            f"{_cell(goodput.get('uptime'), '.3f')} | "
            f"{_cell(sent[0] if sent else None, ',.0f')} | "
            f"{_cell(sent[1] if sent else None, ',.0f')} |"
        )
    lines += ["", "## Plots", ""]
    plots = []
    if plot_eval(runs, "tokens", out / "eval_loss_tokens.png"):
        plot_eval(runs, "wall", out / "eval_loss_wall.png")
        plots += [("eval loss vs tokens", "eval_loss_tokens.png")]
        plots += [("eval loss vs wall time", "eval_loss_wall.png")]
    labels = [r.label for r in runs]
    walls = [float(r.summary.get("wall_s") or 0.0) for r in runs]
    plot_bars(labels, {"wall time": walls}, "Wall time", "seconds", out / "wall_time.png")
    plots.append(("wall time", "wall_time.png"))
    goodputs = {r.label: r.goodput() for r in runs if r.goodput()}
    if goodputs:
        from decoupled_diloco.obs.timeline_plot import plot_goodput

        plot_goodput(goodputs, out / "goodput.png")
        plots.append(("goodput and uptime", "goodput.png"))
    counted = [(r.label, r.bytes_sent()) for r in runs if r.bytes_sent()]
    if counted:  # Only the runs that counted their bytes (log scale: no zero bars).
        series = {
            "bytes sent": [x[0] for _, x in counted],
            "dp equivalent": [x[1] for _, x in counted],
        }
        names = [label for label, _ in counted]
        plot_bars(names, series, "Bytes sent", "bytes", out / "bytes.png", log=True)
        plots.append(("bytes sent", "bytes.png"))
    for title, name in plots:
        lines += [f"![{title}](comparison/{name})", ""]
    path = workdir / "comparison.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str]) -> None:
    """Trains each mode (unless already finished) and writes the comparison."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        config = config_lib.from_config_dict(_CONFIG.value)
    except config_lib.ConfigError as error:
        raise app.UsageError(str(error)) from None
    unknown = [m for m in _MODES.value if m not in config_lib.MODES]
    if unknown:
        raise app.UsageError(f"--modes: unknown {unknown}; expected some of {config_lib.MODES}")
    for mode in _MODES.value:  # Check every mode's config now, not after the first run.
        try:
            config_lib.replace(config, mode=mode)
        except config_lib.ConfigError as error:
            raise app.UsageError(f"--config.mode={mode}: {error}") from None
    from decoupled_diloco.config import write_config_file

    workdir = pathlib.Path(_WORKDIR.value).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = write_config_file(config, workdir / "config.py")
    for mode in _MODES.value:
        if _RERUN.value or not finished(workdir / mode, config_lib.replace(config, mode=mode)):
            try:
                run_mode(config_file, mode, workdir / mode)
            except RuntimeError as error:
                sys.exit(f"[compare] {error}")
        else:
            print(f"[compare] {mode}: same config already finished in {workdir / mode}, kept")
    path = write_comparison(workdir, _MODES.value)
    print(path.read_text().split("## Plots")[0].rstrip())
    print(f"\n[compare] table and plots: {path} and {path.with_suffix('')}/", flush=True)


if __name__ == "__main__":
    app.run(main)
