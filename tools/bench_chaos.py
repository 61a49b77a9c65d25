"""Chaos: goodput and uptime of every mode under one failure schedule; the torchft scenario.

  python -m tools.bench_chaos --out=benchmarks/results/chaos.md

Every run is a real `python -m experiments.train` process tree (decoupled: a syncer and one
process per learner on 127.0.0.1); faults are real `kill -9`s from `decoupled_diloco.chaos.faults`,
restarts come from `decoupled_diloco.local.supervisor`, and goodput/uptime are computed from the
learners' timelines (`decoupled_diloco.obs.timeline`, definitions in docs/DESIGN.md).

1. MTBF: 4 learners, tiny_lm, each learner failing on average every `--mtbf` s of its uptime
   (exponential, seeded) with a `--repair` s repair, the same schedule for the three modes.
   decoupled trains `--steps` steps per learner, once failure-free and once under the schedule
   (final eval loss at equal tokens). dp and diloco run under the schedule for at most
   `--sync_cap` times the decoupled chaos run's wall time: a synchronous job stops whenever
   any learner is down, so it may not finish; its goodput/uptime are then those of that window.
2. torchft scenario: 2 learners, tiny_lm, H=10, 300 steps each; learner 1 is killed at 40% of
   its steps and restarted 10 s later (`--kills` runs, for the median restart time), plus one
   failure-free run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
from concurrent import futures
from typing import Any

from decoupled_diloco.obs import timeline as timeline_lib
from decoupled_diloco.obs.timeline_plot import plot_goodput, plot_timeline
from tools.benchkit import RESULTS, ROOT, Section, train
from tools.benchkit.runs import FAST_CACHE, metrics
from tools.decoupled_variants import STANDBY, TINY_DECOUPLED_BEFORE_GATHER


def run(
    workdir: pathlib.Path, config: str, overrides: dict[str, Any], cap_s: float | None = None
) -> dict[str, Any]:
    """One run under faults (`benchkit.train`, restarts compiling from the persistent cache)."""
    return train(workdir, config, overrides, cap_s, tag="bench_chaos", env=FAST_CACHE)


def _events(workdir: pathlib.Path) -> list[dict[str, Any]]:
    """The run's fault, recovery and membership events."""
    return [r for r in metrics(workdir) if "event" in r]


def steady_goodput(workdir: pathlib.Path) -> float:
    """Goodput from each learner's first step on: without the one-time start of the run."""
    trimmed = {}
    for learner, records in timeline_lib.load(workdir / "timeline").items():
        first = next((i for i, r in enumerate(records) if r.state == "stepping"), len(records))
        trimmed[learner] = records[first:]
    return timeline_lib.analyze({k: v for k, v in trimmed.items() if v}, t_end=None).goodput


def uptime_while_all_have_work(workdir: pathlib.Path) -> float:
    """Uptime over the window up to the first learner's last step.

    With a fixed number of steps per learner, the end of a run under failures is a tail in which
    only learners that lost time are left (and may be down for repair); this leaves it out.
    """
    records = timeline_lib.load(workdir / "timeline")
    t_end = max(r[-1].t for r in records.values())
    spans = {
        k: [(a, b) for a, b, x in timeline_lib.intervals(r, t_end) if x.state == "stepping"]
        for k, r in records.items()
    }
    lo = min(a for v in spans.values() for a, _ in v)
    hi = min(max(b for _, b in v) for v in spans.values() if v)
    covered, cursor = 0.0, lo
    for a, b in sorted(x for v in spans.values() for x in v):
        a, b = max(a, cursor), min(b, hi)
        if b > a:
            covered, cursor = covered + b - a, b
    return covered / (hi - lo) if hi > lo else float("nan")


def _schedule(path: pathlib.Path, mtbf: float, repair: float, horizon: float, seed: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"seed: {seed}\nfailure_model: {{mtbf_s: {mtbf}, repair_s: {repair}, "
        f"duration_s: {horizon}}}\n"
    )
    return str(path)


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


# Scenario 1 ----------------------------------------------------------------------------------


def mtbf_scenario(args: argparse.Namespace, root: pathlib.Path, section: Section) -> list[str]:
    """4 learners under one seeded failure model: the three modes side by side."""
    schedule = _schedule(root / "mtbf.yaml", args.mtbf, args.repair, args.horizon, args.seed)
    common = {"num_learners": 4, "train_steps": args.steps, "checkpoint.every": args.ckpt}
    common.update({"eval.every": 0, "log_every": 50})
    decoupled_cfg = "experiments/configs/tiny_lm_decoupled.py"
    # The settings these runs were measured with; quorum 1 merges of about one learner each,
    # so an outer step of 1/M sums to about a plain average per round.
    decoupled = {**TINY_DECOUPLED_BEFORE_GATHER, **common, "outer.lr": 1 / common["num_learners"]}
    chaos = run(
        root / "decoupled_chaos", decoupled_cfg, {**decoupled, **STANDBY, "chaos": schedule}
    )
    cap = args.sync_cap * chaos["wall_s"]
    # dp and diloco side by side (each under its own copy of the schedule): one cap for both.
    with futures.ThreadPoolExecutor(2) as pool:
        jobs = {
            mode: pool.submit(
                run,
                root / f"{mode}_chaos",
                "experiments/configs/tiny_lm.py",
                {**common, "mode": mode, "chaos": schedule},
                cap,
            )
            for mode in ("dp", "diloco")
        }
        sync = {mode: job.result() for mode, job in jobs.items()}
    free = run(root / "decoupled_free", decoupled_cfg, decoupled)  # last: may run alongside
    runs = {"decoupled": chaos, **sync}
    steady = {name: steady_goodput(root / f"{name}_chaos") for name in runs}
    plot_goodput(runs, RESULTS / "chaos_goodput.png")
    for name in ("decoupled_chaos", "dp_chaos"):
        try:
            shutil.copy(plot_timeline(root / name), RESULTS / f"chaos_timeline_{name}.png")
        except Exception as error:  # noqa: BLE001 - a picture is optional
            print(f"[bench_chaos] no timeline picture for {name}: {error}", flush=True)
    loss_ratio = chaos["final_eval_loss"] / free["final_eval_loss"]
    title = f"1. Four learners, each failing every {args.mtbf:.0f} s on average"
    section.claim(
        f"decoupled goodput, M=4, MTBF {args.mtbf:.0f} s per learner",
        round(chaos["goodput"], 3),
        baseline=f"dp {_fmt(sync['dp']['goodput'])}, diloco "
        f"{_fmt(sync['diloco']['goodput'])} (capped)",
        goal="≥ 0.85",
        met=chaos["goodput"] >= 0.85,
        headline=True,
        section=title,
    )
    section.claim(
        "decoupled final eval loss, failures / failure-free",
        round(loss_ratio, 4),
        unit="×",
        goal="≤ 1.03",
        met=loss_ratio <= 1.03,
        section=title,
    )
    lines = [
        "### 1. Four learners, each failing every "
        f"{args.mtbf:.0f} s on average (repair {args.repair:.0f} s)",
        "",
        f"Schedule: `failure_model: {{mtbf_s: {args.mtbf}, repair_s: {args.repair}, "
        f"duration_s: {args.horizon}}}`, seed {args.seed} (kill -9 of a learner; in dp/diloco "
        "that kills the whole job). tiny_lm configs, M=4, "
        f"{args.steps} steps per learner, checkpoints every {args.ckpt} steps. dp and diloco ran "
        f"at the same time as each other, capped at {args.sync_cap}× the decoupled chaos run's "
        f"wall time ({cap:.0f} s); the decoupled failure-free run ran alongside the chaos one. "
        "Decoupled: outer lr 1/M = 0.25; restarts activate a warm standby learner "
        "(`supervisor.standby=1`).",
        "",
        "| mode | goodput | goodput after start-up | uptime | faults injected | recoveries | "
        "lost steps | steps done | wall s | finished |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, s in runs.items():
        lines.append(
            f"| {name} | {_fmt(s['goodput'])} | {_fmt(steady[name])} | {_fmt(s['uptime'])} | "
            f"{s['failures_injected']} "
            f"| {s['recoveries']} | {s['lost_steps']} | {s['steps_done']} | {s['wall_s']:.0f} | "
            f"{'no (cap)' if s.get('capped') else 'yes'} |"
        )
    lines += [
        "",
        f"decoupled failure-free: goodput {free['goodput']:.3f}, uptime {free['uptime']:.3f}, "
        f"wall {free['wall_s']:.0f} s, final eval loss {free['final_eval_loss']:.4f}; under the "
        f"schedule: {chaos['final_eval_loss']:.4f} at equal tokens ({chaos['tokens']:,} vs "
        f"{free['tokens']:,}), ratio **{loss_ratio:.4f}** (target ≤ 1.03). "
        f"Targets: decoupled goodput ≥ 0.85 (measured **{chaos['goodput']:.3f}**), uptime 1.0 "
        f"(measured **{chaos['uptime']:.3f}**; up to the first learner's last step: "
        f"**{uptime_while_all_have_work(root / 'decoupled_chaos'):.3f}** — after it, only "
        "learners that lost time to failures are left, and the run waits for them while they are "
        "down). 'Goodput after start-up' counts each learner "
        "from its first step on (the one-time start of the run, the same for every mode, left "
        "out); restarts after failures stay in.",
        "",
        _where_time_went(chaos),
        "",
        "![goodput](chaos_goodput.png)  ![decoupled timeline](chaos_timeline_decoupled_chaos.png)"
        "  ![dp timeline](chaos_timeline_dp_chaos.png)",
        "",
    ]
    return lines


def _where_time_went(summary: dict[str, Any]) -> str:
    totals: dict[str, float] = {}
    for learner in summary["timeline"]["learners"].values():
        for state, seconds in learner["by_state"].items():
            totals[state] = totals.get(state, 0.0) + seconds
    total = sum(v for k, v in totals.items() if k != "down") or 1.0
    parts = ", ".join(
        f"{k} {100 * v / total:.1f}%"
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
        if k not in ("down", "done") and v > 0
    )
    return f"Where the decoupled learners' allocated time went (summed): {parts}."


# Scenario 2 ----------------------------------------------------------------------------------


def _restart_to_step(workdir: pathlib.Path, learner: int) -> tuple[float, float]:
    """Seconds from the restart (process spawn) to the first step's start and to its end."""
    records = timeline_lib.load(workdir / "timeline")[learner]
    down = next(i for i, r in enumerate(records) if r.state == "down")
    start = next(r for r in records[down:] if r.state == "starting")
    first = next(i for i, r in enumerate(records) if r.t > start.t and r.state == "compiling")
    return records[first].t - start.t, records[first + 1].t - start.t


def _rate(workdir: pathlib.Path, learner: int, t_from: float, t_to: float) -> float:
    """Steps per second `learner` started in [t_from, t_to]."""
    records = timeline_lib.load(workdir / "timeline")[learner]
    steps = [r for r in records if r.state == "stepping" and t_from <= r.t <= t_to]
    return (len(steps) - 1) / (steps[-1].t - steps[0].t) if len(steps) > 2 else float("nan")


def _longest_gap(workdir: pathlib.Path, learner: int, t_from: float, t_to: float) -> float:
    """The longest time between two consecutive step starts of `learner` in [t_from, t_to]."""
    records = timeline_lib.load(workdir / "timeline")[learner]
    starts = [r.t for r in records if r.state in timeline_lib.STEP_STATES and t_from <= r.t <= t_to]
    return max((b - a for a, b in zip(starts, starts[1:], strict=False)), default=float("nan"))


def torchft_scenario(args: argparse.Namespace, root: pathlib.Path, section: Section) -> list[str]:
    """2 learners, H=10, 300 steps; learner 1 killed at step 120, restarted 10 s later."""
    common = {
        "num_learners": 2,
        "inner_steps": 10,
        "train_steps": args.ft_steps,
        "checkpoint.every": args.ft_ckpt,
        "eval.every": 0,
        "log_every": 50,
        **TINY_DECOUPLED_BEFORE_GATHER,  # the settings these runs were measured with
    }
    cfg = "experiments/configs/tiny_lm_decoupled.py"
    free = run(root / "ft_free", cfg, common)
    path = root / "ft.yaml"
    at = int(0.4 * args.ft_steps)
    path.write_text(f"faults:\n  - {{at_step: {at}, kind: kill, learner: 1, repair_s: 10}}\n")
    rows, starts, firsts, ratios, goodputs, losses = [], [], [], [], [], []
    for k in range(args.kills):
        workdir = root / f"ft_chaos_{k}"
        s = run(workdir, cfg, {**common, **STANDBY, "chaos": str(path)})
        kill_t = next(e["time"] for e in _events(workdir) if e.get("event") == "fault")
        to_start, to_step = _restart_to_step(workdir, 1)
        records = timeline_lib.load(workdir / "timeline")[1]
        back = next(r.t for r in records if r.t > kill_t + 10 and r.state == "stepping")
        # Survivor's rate while learner 1 was down and restarting vs the same window of steps
        # in the failure-free run (same seed 0 only for k = 0; the rates are per-run anyway).
        during = _rate(workdir, 0, kill_t, back)
        before = _rate(workdir, 0, kill_t - (back - kill_t), kill_t)
        gap = _longest_gap(workdir, 0, kill_t, back)
        gap_before = _longest_gap(workdir, 0, kill_t - (back - kill_t), kill_t)
        free_records = timeline_lib.load(root / "ft_free" / "timeline")[0]
        steps_window = [
            r.step for r in timeline_lib.load(workdir / "timeline")[0] if kill_t <= r.t <= back
        ]
        lo, hi = (min(steps_window), max(steps_window)) if steps_window else (0, 0)
        free_steps = [r for r in free_records if r.state == "stepping" and lo <= r.step <= hi]
        free_rate = (
            (len(free_steps) - 1) / (free_steps[-1].t - free_steps[0].t)
            if len(free_steps) > 2
            else float("nan")
        )
        starts.append(to_start)
        firsts.append(to_step)
        ratios.append(during / free_rate)
        goodputs.append(s["goodput"])
        losses.append(s["final_eval_loss"])
        rows.append(
            f"| {k} | {during:.2f} | {before:.2f} | {free_rate:.2f} | {during / free_rate:.2f} | "
            f"{gap:.1f} / {gap_before:.1f} | "
            f"{to_start:.1f} | {to_step:.1f} | {s['goodput']:.3f} | {s['lost_steps']} | "
            f"{s['final_eval_loss']:.4f} |"
        )
    section.claim(
        "torchft scenario restart → first step done, median",
        round(statistics.median(firsts), 1),
        unit="s",
        goal="≤ 4 s",
        met=statistics.median(firsts) <= 4.0,
        section="2. torchft scenario",
    )
    section.claim(
        f"torchft scenario goodput, median of {args.kills} runs",
        round(statistics.median(goodputs), 3),
        baseline="torchft 0.73",
        goal="≥ 0.85",
        met=statistics.median(goodputs) >= 0.85,
        headline=True,
        section="2. torchft scenario",
    )
    return [
        "### 2. torchft scenario: 2 learners, H=10, 300 steps, kill -9 at 40%, restart after 10 s",
        "",
        f"tiny_lm_decoupled, learner checkpoints every {args.ft_ckpt} steps, one warm standby "
        f"(`supervisor.standby=1`); {args.kills} runs "
        "(same seed), one kill each, plus one failure-free run. Survivor rate: learner "
        "0's steps/s from the kill until learner 1 steps again; 'before': the same length of "
        "time before the kill; 'free': the failure-free run over the same step numbers.",
        "",
        "| run | survivor steps/s during | before | failure-free | during/free | survivor's "
        "longest step gap during / before (s) | restart → first step starts (s) | restart → "
        "first step done (s) | goodput | lost steps | final eval loss |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Median restart → first step done: **{statistics.median(firsts):.1f} s** (target ≤ 4 s;"
        f" to the first step's start {statistics.median(starts):.1f} s). Survivor rate during "
        f"the failure / failure-free: median **{statistics.median(ratios):.2f}** (target: within "
        f"noise of 1). Goodput median **{statistics.median(goodputs):.3f}** (target ≥ 0.85; "
        f"torchft 0.73). Final eval loss median {statistics.median(losses):.4f} vs failure-free "
        f"{free['final_eval_loss']:.4f} (target ≤ +0.03: "
        f"**{statistics.median(losses) - free['final_eval_loss']:+.4f}**); failure-free goodput "
        f"{free['goodput']:.3f}.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--workroot", default=str(ROOT / "runs" / "bench_chaos"))
    parser.add_argument("--only", default="mtbf,torchft")
    parser.add_argument("--steps", type=int, default=600, help="MTBF: steps per learner")
    parser.add_argument("--ckpt", type=int, default=10, help="MTBF: checkpoint every")
    parser.add_argument("--mtbf", type=float, default=120.0)
    parser.add_argument("--repair", type=float, default=20.0)
    parser.add_argument("--horizon", type=float, default=3600.0, help="failures up to (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync_cap", type=float, default=0.75)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--ft_ckpt", type=int, default=20)
    parser.add_argument("--ft_steps", type=int, default=300)
    args = parser.parse_args()
    root = pathlib.Path(args.workroot)
    RESULTS.mkdir(parents=True, exist_ok=True)
    section = Section("chaos")
    load_before = os.getloadavg()
    body: list[str] = []
    for name, scenario in (("mtbf", mtbf_scenario), ("torchft", torchft_scenario)):
        if name in args.only:
            body += scenario(args, root, section)
            _write(args.out, section, load_before, body)  # each scenario's part as it ends


def _write(out: str, section: Section, load_before: tuple, body: list[str]) -> None:
    load_after = os.getloadavg()
    lines = [
        "## Chaos: goodput and uptime under failures, all modes (issue 5)",
        "",
        f"{section.header()} "
        f"Load average {load_before[0]:.1f} at the start and {load_after[0]:.1f} at the end on "
        f"{os.cpu_count()} cores (the runs' own processes count: a decoupled run is 4 learners, "
        "a syncer and a spare; anything else running makes restarts slower and goodput lower). "
        "Definitions: docs/chaos.md, 'Goodput and uptime'.",
        "",
        *body,
    ]
    section.write(out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
