"""The tiny_lm setting that the quality benchmarks share, and time to a target loss.

tiny_lm (0.5M parameters) on the default corpus, 32 fixed validation batches: `dp` and
`diloco` baselines at M=2, H=50, 300 steps per learner (`SHORT`) and M=4, 2,000 steps (`LONG`),
and decoupled runs on top of the same flags. A run's directory is named after the run, so a
renamed run runs again; a finished run of the same config is reused (`benchkit.runs`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

from tools.benchkit.runs import train

CONFIG = "experiments/configs/tiny_lm.py"
COMMON = {"eval.batches": 32, "eval.every": 500, "checkpoint.every": 0, "log_every": 100}
SHORT = {"num_learners": 2, "inner_steps": 50, "train_steps": 300}
LONG = {"num_learners": 4, "inner_steps": 50, "train_steps": 2000}
# Outer optimizer settings (lr, momentum, nesterov) swept for `diloco`: the DiLoCo default
# (0.7, 0.9, Nesterov), plain averaging (FedAvg: lr 1, no momentum) and a lighter momentum.
OUTER = ((0.7, 0.9, True), (1.0, 0.0, False), (0.7, 0.5, True))
TIME_FACTORS = (1.0, 1.05, 1.1, 1.2)  # thresholds of the time-to-loss columns, × dp's loss


def baseline(
    name: str,
    mode: str,
    outer: tuple[float, float, bool],
    workroot: pathlib.Path,
    setting: Mapping[str, Any] = SHORT,
) -> dict[str, Any]:
    """A `dp` or `diloco` run: `setting` with the outer optimizer (lr, momentum, nesterov)."""
    lr, momentum, nesterov = outer
    overrides = {**COMMON, "mode": mode, "outer.lr": lr, "outer.momentum": momentum}
    overrides |= {"outer.nesterov": nesterov, **setting}
    workdir = workroot / name.replace(":", "_").replace(" ", "_")
    return train(workdir, CONFIG, overrides, tag="bench", shown_root=workroot)


def short_baselines(workroot: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The M=2 dp run and the diloco run with plain averaging (lr 1, no momentum)."""
    dp = baseline("short:dp", "dp", OUTER[0], workroot)
    diloco = baseline("short:diloco lr1.0-m0.0", "diloco", OUTER[1], workroot)
    return dp, diloco


def run(name: str, overrides: Mapping[str, Any], workroot: pathlib.Path) -> dict[str, Any]:
    """Any other run of the setting: `COMMON` with `overrides`, in `workroot/name`."""
    return train(workroot / name, CONFIG, {**COMMON, **overrides}, shown_root=workroot)


def time_to(summary: Mapping[str, Any], target: float) -> float | None:
    """Training seconds until the first eval loss ≤ target (from the first training step)."""
    lines = summary["metrics"]
    started = [x["wall_s"] for x in lines if x.get("step", 0) > 0]
    t0 = started[0] if summary["mode"] == "decoupled" and started else 0.0
    for x in lines:
        if x.get("eval_loss") is not None and x["eval_loss"] <= target:
            return x["wall_s"] - t0
    final = summary["final_eval_loss"]
    return summary["train_wall_s"] if final is not None and final <= target else None


def time_header(dp_loss: float) -> str:
    """The time-to-loss column titles (see `time_cells`)."""
    return " | ".join(f"to ≤ {f:.2f}×dp ({f * dp_loss:.3f})" for f in TIME_FACTORS)


def time_cells(summary: Mapping[str, Any], dp_loss: float) -> str:
    """Table cells: seconds until the eval loss first reaches each `TIME_FACTORS` × dp_loss."""
    times = [time_to(summary, f * dp_loss) for f in TIME_FACTORS]
    return " | ".join("not reached" if t is None else f"{t:.0f}" for t in times)
