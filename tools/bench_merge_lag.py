"""Merge lag: the steps a learner trains away from a merged value, and their cost (issue 3).

  python -m tools.bench_merge_lag --out=benchmarks/results/merge_lag.md

A merge's lag is the number of inner steps between the push it answers and the step boundary
where the learner applies it. Those steps start from the learner's own unmerged values (with
`keep_overlap` they are kept on top of the merge), so the longer the lag, the further the
learners drift from synchronous DiLoCo. Each learner's summary lists its applied merges
(`applied`: fragment, version, pushed_at, applied_at).

Two runs per setting are not enough on this machine (the same decoupled command spreads by
about ±0.01 in its ratio to dp), so each M=2 setting runs `REPEATS` times. The M=4 runs are the
issue's 2,000-step setting (`LONG_REPEATS` runs); the last setting has one of the two learners
3x slower (the heterogeneity target: dp's loss in less wall time than diloco). Every run is a
real `python -m experiments.train` process; a finished run is reused (delete its directory
under runs/bench to rerun it). dp and diloco are `tools.bench_quality`'s commands (and reuse
its runs).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

from tools.benchkit import ROOT, Section
from tools.benchkit.tiny import LONG, baseline, run, short_baselines, time_cells, time_header
from tools.decoupled_variants import DECOUPLED, GATHER, SETTING, SHARE, SLOW, SLOW_STEPS

REPEATS = 4
LONG_REPEATS = 2
# gather + share (tiny_lm_decoupled.py's settings before apply_on_arrival): a merge is applied
# τ=10 steps after its push, or on arrival if later.
AFTER_TAU = {**DECOUPLED, **GATHER, **SHARE}
# The same, the merge applied at the first step boundary after it arrives (τ still sizes the
# syncer's grace window): tiny_lm_decoupled.py's settings now.
ON_ARRIVAL = {**AFTER_TAU, "decoupled.apply_on_arrival": True}
SETTINGS = (("applied after τ=10", "after_tau", AFTER_TAU), ("on arrival", "arrival", ON_ARRIVAL))


def lags(summary: dict) -> list[int]:
    """Every applied merge's lag in steps, over all learners."""
    return [
        a["applied_at"] - a["pushed_at"]
        for learner in summary.get("learners", [])
        for a in learner.get("applied", [])
        if a["pushed_at"] >= 0
    ]


def _lag_text(summary: dict) -> str:
    """The run's merge lags as "mean / max" ("-" for dp and diloco)."""
    lag = lags(summary)
    return f"{statistics.mean(lag):.1f} / {max(lag)}" if lag else "-"


def _row(name: str, s: dict, base_loss: float) -> str:
    """A table row; the ratio is to `base_loss` (dp's at M=2, diloco's at M=4)."""
    stall = max(x["stall_fraction"] for x in s["learners"]) if "learners" in s else None
    cells = [
        name,
        f"{s['final_eval_loss']:.4f}",
        f"{s['final_eval_loss'] / base_loss:.4f}",
        str(s.get("outer_syncs", "-")),
        _lag_text(s),
        "-" if stall is None else f"{100 * stall:.3f}%",
        f"{s['wall_s']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _long(workroot: pathlib.Path, runs: list[dict]) -> list[str]:
    """M=4 at the foundation's 2,000-step setting against its diloco run (appended to `runs`)."""
    long = LONG
    long_diloco = baseline("long:diloco lr1.0-m0.0", "diloco", (1.0, 0.0, False), workroot, long)
    d_loss = long_diloco["final_eval_loss"]
    lines = [
        "### M=4, H=50, 2,000 steps per learner (16.4M tokens per run)",
        "",
        "Target: decoupled final eval loss ≤ 1.01 × diloco's (dp: "
        "`benchmarks/results/quality.md`).",
        "",
        "| run | final eval loss | ratio to diloco | merges | lag mean / max (steps) | "
        "learner stall (max) | wall s |",
        "|---|---|---|---|---|---|---|",
        _row("diloco sgd 1.0/0.0", long_diloco, d_loss),
    ]
    runs.append(long_diloco)
    for i in range(LONG_REPEATS):
        name = "lag_long_arrival" + (f"_{i + 1}" if i else "")
        s = run(name, {"mode": "decoupled", **long, **ON_ARRIVAL}, workroot)
        lines.append(_row(f"decoupled on arrival, run {i + 1}", s, d_loss))
        runs.append(s)
    return [*lines, ""]


def _slow(workroot: pathlib.Path, runs: list[dict], dp_loss: float) -> list[str]:
    """One learner 3x slower: seconds until the global model reaches dp's loss, and near it."""
    slow = {**SETTING, **SLOW, "train_steps": SLOW_STEPS}
    # diloco: `tools.bench_decoupled`'s run of the same command (a finished one is reused).
    slow_diloco = run(
        f"slow3x_{SLOW_STEPS}_diloco_lr1.0-m0.0",
        {"mode": "diloco", **slow, "outer.lr": 1.0, "outer.momentum": 0.0},
        workroot,
    )
    slow_dec = run(
        f"slow3x_{SLOW_STEPS}_decoupled_arrival",
        {"mode": "decoupled", **slow, **ON_ARRIVAL},
        workroot,
    )
    lines = [
        "### M=2, one learner 3x slower, 600 steps per learner",
        "",
        "Target: decoupled reaches dp's final eval loss (the M=2 table's dp) in less wall time "
        "than diloco, which waits for the slow learner at every sync. Seconds of training "
        "(process start-up excluded) until the global model's eval loss first reaches the "
        "threshold, evaluated every 50 steps.",
        "",
        "| run | final eval loss | lag mean / max (steps) | wall s | "
        + time_header(dp_loss)
        + " |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in (("diloco sgd 1.0/0.0", slow_diloco), ("decoupled on arrival", slow_dec)):
        cells = time_cells(s, dp_loss)
        loss, wall = s["final_eval_loss"], s["wall_s"]
        lines.append(f"| {name} | {loss:.4f} | {_lag_text(s)} | {wall:.0f} | {cells} |")
    runs += [slow_diloco, slow_dec]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench"))
    parser.add_argument("--skip_long", action="store_true", help="skip the M=4 2,000-step runs")
    parser.add_argument("--skip_slow", action="store_true", help="skip the 3x-slower-learner runs")
    args = parser.parse_args()
    workroot = pathlib.Path(args.workroot)
    section = Section("merge_lag")
    dp, diloco = short_baselines(workroot)
    dp_loss = dp["final_eval_loss"]
    header = "| run | final eval loss | ratio to dp | merges | lag mean / max (steps) | "
    lines = [
        "## Merge lag: when a learner applies a merged fragment (issue 3)",
        "",
        f"{section.header()} Finished runs are reused. tiny_lm, default corpus, 32 fixed "
        "validation batches; decoupled: gather + share (P=4, quorum 1, τ=10, γ=1, grace ≤ 10 s, "
        "keep_overlap, share, learner anchor, RDA, outer SGD lr 1). Lag: inner steps from a "
        "push to the step boundary where the learner applies the merge answering it, over "
        "every applied merge of every learner. Every run here keeps at most two inner steps "
        "in flight (`Island.step`); the runs of `decoupled.md` were made before that bound "
        "(two exploratory M=2 runs with τ=10 before it: merges applied 10-13 steps after "
        "their push, and 1-13, mostly 12-13, with apply_on_arrival).",
        "",
        "### M=2, H=50, 300 steps per learner",
        "",
        header + "learner stall (max) | wall s |",
        "|---|---|---|---|---|---|---|",
        _row("dp", dp, dp_loss),
        _row("diloco sgd 1.0/0.0", diloco, dp_loss),
    ]
    runs, summary_lines = [dp, diloco], []
    for label, tag, overrides in SETTINGS:
        ratios = []
        for i in range(REPEATS):
            s = run(f"lag_m2_{tag}_{i}", {"mode": "decoupled", **SETTING, **overrides}, workroot)
            lines.append(_row(f"decoupled {label}, run {i + 1}", s, dp_loss))
            ratios.append(s["final_eval_loss"] / dp_loss)
            runs.append(s)
        summary_lines.append(
            f"- {label}: ratio to dp mean **{statistics.mean(ratios):.4f}** over {REPEATS} runs "
            f"of the same command (range {min(ratios):.4f}-{max(ratios):.4f}; "
            f"{sum(r <= 1.08 for r in ratios)} of {REPEATS} ≤ 1.08)."
        )
    lines += ["", *summary_lines, ""]
    if not args.skip_long:
        lines += _long(workroot, runs)
    if not args.skip_slow:
        lines += _slow(workroot, runs, dp_loss)
    lines += ["Commands of each run:", ""]
    lines += [f"- `{s['command']}`" for s in runs]
    section.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
