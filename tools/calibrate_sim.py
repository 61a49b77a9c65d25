"""Calibrates the goodput simulator against a finished local chaos run (issue 6).

`python -m tools.calibrate_sim RUN_DIR [RUN_DIR ...]` reads each run's timelines
(`timeline/*.jsonl`), fault events (`metrics.jsonl`) and config, extracts what the simulator
needs — the kill schedule, the mean step time, the restart time (kill -> process back), the
rejoin time (process start -> first step that counts: starting + restoring + compiling), the
one-time start-up and the checkpoint cadence — feeds them to
`decoupled_diloco.sim.goodput_from_schedule`, and prints predicted vs measured goodput.

Where the simulator's accounting differs from the run's (docs/chaos.md, "Goodput and uptime"),
the difference is handled explicitly, never by tuning numbers:

* **Repair time is not billed** in the run (a dead machine is `down`, not allocated); the
  simulator bills its whole allocation for the whole wall time. So the prediction is re-expressed
  in the run's definition: predicted productive learner-time / (M x predicted wall - the
  learner-time the simulated learners spend down), the down time following the simulator's own
  rule on the same schedule (a failure takes an up learner down for `restart_s`).
* **A run stopped at its time cap** (dp/diloco in the chaos benchmark) did not finish. It is
  compared over the same window: the prediction is the largest step count the simulated job
  completes by the cap, divided by the same window's allocated time.
* **The one-time start of the run** is passed as `startup_s` (measured: each learner's first
  record to its first counted step, averaged), so both sides bill it.
* **What a decoupled failure loses.** The real learner restores its own last checkpoint and
  re-executes the steps since (the timeline counts those as lost: on average C/2 steps with a
  checkpoint every C steps); merged fragments that overwrite its progress are not counted by the
  timeline metric. The simulator's one per-failure loss for a learner is the stale-round loss,
  which for an absence of at least H steps is H/2 steps. The tool passes H := C, so the
  simulated loss is the same mechanism's mean; `--real_h` passes the run's sync period instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from decoupled_diloco import timeline as timeline_lib
from decoupled_diloco.sim import goodput_from_schedule

SYNC_MODES = ("dp", "diloco")


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a finished chaos run measured, in the simulator's terms (seconds from run start).

    Attributes:
        mode: "decoupled", "dp" or "diloco".
        num_learners: M.
        train_steps: Steps per learner the run was configured for.
        steps_done: Highest step index any learner completed within the window (the
            timeline counts the last execution of each step index as productive, so this many
            steps' time is productive).
        checkpoint_every: Checkpoint cadence in steps (0: none).
        sync_every_steps: Steps between two syncs of one fragment (decoupled: inner_steps).
        kills: `(time_s, learner)` of every kill injected.
        step_s: Mean step time, over runs of steps the learner ended itself (`_closed_step_runs`).
        restart_s: Mean time from a kill to the process being started again.
        rejoin_s: Mean time from a restart to the first `stepping` record after it.
        startup_s: Mean time from each learner's first record to its first `stepping` record.
        checkpoint_s: Mean duration of a `checkpointing` record.
        window_s: End of the accounted window (the run's end, or its cap).
        capped: Whether the run was stopped at a time cap before finishing.
        goodput: Measured goodput (timeline definition), recomputed over `window_s`.
        uptime: Measured uptime.
        first_done_s: When the first learner finished its share (None if none did, e.g. capped
            or synchronous runs, whose learners finish together).
        goodput_first_done: Measured goodput over [0, first_done_s] (None with it).
        restarts_measured: How many restarts `restart_s` averages.
        rejoins_measured: How many restarts `rejoin_s` averages (a restart killed again before
            its first step has no rejoin time and is left out).
    """

    mode: str
    num_learners: int
    train_steps: int
    steps_done: int
    checkpoint_every: int
    sync_every_steps: int
    kills: list[tuple[float, int]]
    step_s: float
    restart_s: float
    rejoin_s: float
    startup_s: float
    checkpoint_s: float
    window_s: float
    capped: bool
    goodput: float
    uptime: float
    restarts_measured: int
    rejoins_measured: int
    first_done_s: float | None = None
    goodput_first_done: float | None = None


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return out


def _config(run: pathlib.Path) -> dict[str, Any]:
    for name in ("summary.json", "bench_result.json"):
        path = run / name
        if path.exists():
            data = json.loads(path.read_text())
            if "config" in data:
                return data["config"]
    args = run / "bench_args.json"
    if not args.exists():
        raise ValueError(f"{run}: no summary.json, bench_result.json or bench_args.json")
    # A capped synchronous run has no summary: its config is the benchmark's overrides.
    raw = json.loads(args.read_text())["overrides"]
    return {
        "mode": raw["mode"],
        "num_learners": raw["num_learners"],
        "train_steps": raw["train_steps"],
        "checkpoint": {"every": raw.get("checkpoint.every", 0)},
        "inner_steps": raw.get("inner_steps", 0),
    }


def _mean(values: Sequence[float], what: str, run: pathlib.Path) -> float:
    if not values:
        raise ValueError(f"{run}: no {what} to measure")
    return sum(values) / len(values)


# States a learner enters by itself after a run of steps; any other successor (waiting, down,
# starting: written by the supervisor after a kill) or none (the window's end) cuts the run.
_SELF_ENDED = ("checkpointing", "blocked", "evaluating", "done")


def _closed_step_runs(spans: Sequence[tuple[float, float, timeline_lib.Record]]) -> list[float]:
    """Per-step time of each run of consecutive `stepping` records that the learner ended itself.

    Why only those: steps are dispatched asynchronously, so a `stepping` record can end before its
    step has run, and the wait shows up in a later record (the one before a checkpoint, which
    blocks). A run cut by a kill has recorded steps that never finished computing, which would
    make the mean step look shorter than it is. Each closed run contributes its total time
    divided by its steps, once per step.
    """
    out: list[float] = []
    run: list[float] = []
    for i, (start, end, rec) in enumerate(spans):
        if rec.state == "stepping":
            run.append(end - start)
            nxt = spans[i + 1][2].state if i + 1 < len(spans) else ""
            if nxt != "stepping":
                if nxt in _SELF_ENDED:
                    out.extend([sum(run) / len(run)] * len(run))
                run = []
    return out


def extract(run: str | pathlib.Path) -> RunFacts:
    """Reads a finished chaos run directory into `RunFacts`.

    Raises:
        ValueError: If the directory lacks timelines or metrics, or measures no step.
    """
    run = pathlib.Path(run)
    tl_dir = run / "timeline"
    metrics = run / "metrics.jsonl"
    if not tl_dir.is_dir() or not metrics.exists():
        raise ValueError(f"{run}: not a chaos run (needs timeline/ and metrics.jsonl)")
    cfg = _config(run)
    mode = str(cfg["mode"])
    records = timeline_lib.load(tl_dir)
    if not records:
        raise ValueError(f"{run}: empty timeline")
    t0 = min(r[0].t for r in records.values() if r)
    events = _read_jsonl(metrics)
    kills = sorted(
        (float(e["time"]) - t0, int(e["learner"]))
        for e in events
        if e.get("event") == "fault" and e.get("kind") == "kill"
    )

    args_path = run / "bench_args.json"
    cap_s = json.loads(args_path.read_text()).get("cap_s") if args_path.exists() else None
    summary_path = run / "summary.json"
    capped = cap_s is not None and not summary_path.exists()
    if capped:
        # The benchmark stopped the job `wall_s` after launching it; the supervisor's first
        # record is written right after the launch.
        wall = json.loads((run / "bench_result.json").read_text())["wall_s"]
        t_end = t0 + float(wall)
    else:
        t_end = max(r[-1].t for r in records.values() if r)
    measured = timeline_lib.analyze(records, t_end=t_end)

    step_durations: list[float] = []
    ckpt_durations: list[float] = []
    startups: list[float] = []
    rejoins: list[float] = []
    restarts: list[float] = []
    steps_done = 0
    # A synchronous job's learners share every record: measure it once, as learner min(ids).
    learners = [min(records)] if mode in SYNC_MODES else sorted(records)
    for learner in learners:
        spans = timeline_lib.intervals(records[learner], t_end)
        first_step = next((s for s, _, r in spans if r.state == "stepping"), None)
        if first_step is not None:
            startups.append(first_step - spans[0][0])
        step_durations.extend(_closed_step_runs(spans))
        steps_done = max([steps_done, *(r.step for _, _, r in spans if r.state == "stepping")])
        for start, end, rec in spans:
            if rec.state == "checkpointing":
                ckpt_durations.append(end - start)
        starts = [s for s, _, r in spans if r.state == "starting"][1:]  # [0]: the run's start
        mine = [t for t, who in kills if mode in SYNC_MODES or who == learner]
        prev_start = spans[0][0]
        for start in starts:
            # Kills since the previous start (several can land while a synchronous job is down);
            # the restart runs from the first of them.
            since = [t0 + t for t in mine if prev_start < t0 + t <= start]
            if since:
                restarts.append(start - min(since))
            nxt_kill = min((t0 + t for t in mine if t0 + t > start), default=math.inf)
            first = next(
                (s for s, _, r in spans if r.state == "stepping" and start < s < nxt_kill), None
            )
            if first is not None:
                rejoins.append(first - start)
            prev_start = start

    first_done_s, goodput_first_done = None, None
    dones = [[r.t for r in recs if r.state == "done"] for recs in records.values()]
    if mode not in SYNC_MODES and all(dones):
        first_done = min(d[-1] for d in dones)
        # Up to here every learner still has work, as in the simulator, which pools the work of
        # all learners; after it the run's fixed per-learner shares leave a tail (module doc).
        cut = {k: [r for r in v if r.t <= first_done] for k, v in records.items()}
        first_done_s = first_done - t0
        goodput_first_done = timeline_lib.analyze(cut, t_end=first_done).goodput

    return RunFacts(
        mode=mode,
        num_learners=int(cfg["num_learners"]),
        train_steps=int(cfg["train_steps"]),
        steps_done=steps_done,
        checkpoint_every=int(cfg.get("checkpoint", {}).get("every", 0)),
        sync_every_steps=int(cfg.get("inner_steps", 0)),
        kills=[(t, who) for t, who in kills if t0 + t <= t_end],
        step_s=_mean(step_durations, "stepping records", run),
        restart_s=_mean(restarts, "restarts", run) if restarts else 0.0,
        rejoin_s=_mean(rejoins, "rejoins", run) if rejoins else 0.0,
        startup_s=_mean(startups, "start-ups", run),
        checkpoint_s=sum(ckpt_durations) / len(ckpt_durations) if ckpt_durations else 0.0,
        window_s=t_end - t0,
        capped=capped,
        goodput=measured.goodput,
        uptime=measured.uptime,
        restarts_measured=len(restarts),
        rejoins_measured=len(rejoins),
        first_done_s=first_done_s,
        goodput_first_done=goodput_first_done,
    )


def _down_learner_s(facts: RunFacts, end_s: float) -> float:
    """Learner-seconds the simulated learners spend down (not billed), up to `end_s`.

    The simulator's rule: a kill takes an up learner down for `restart_s`; a kill of a learner
    already down changes nothing.
    """
    down_until = [-math.inf] * facts.num_learners
    total = 0.0
    for t, learner in facts.kills:
        if t >= end_s or down_until[learner] > t:
            continue
        down_until[learner] = t + facts.restart_s
        total += min(facts.restart_s, end_s - t)
    return total


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The simulator's goodput for a run, in the sim's and in the run's definition."""

    system: str
    sim_goodput: float
    sim_uptime: float
    wall_s: float
    steps: float
    goodput: float


def predict(facts: RunFacts, *, end_s: float | None = None, real_h: bool = False) -> Prediction:
    """Feeds `facts` to `goodput_from_schedule` and re-expresses it in the run's definition.

    Args:
        facts: From `extract`.
        end_s: Compare over [0, end_s] instead of the whole run (default: the cap of a capped
            run, else the whole run).
        real_h: Decoupled only: pass the run's sync period as H instead of the checkpoint
            cadence (module doc).
    """
    system = "decoupled" if facts.mode == "decoupled" else "dp"
    h = facts.sync_every_steps if real_h or not facts.checkpoint_every else facts.checkpoint_every
    common = dict(
        num_learners=facts.num_learners,
        step_s=facts.step_s,
        restart_s=facts.restart_s,
        rejoin_s=facts.rejoin_s,
        startup_s=facts.startup_s,
        checkpoint_every_steps=facts.checkpoint_every,
        checkpoint_s=facts.checkpoint_s,
        sync_every_steps=max(h, 1),
        # The local run has no spare machine: the killed learner itself is restarted, so a kill
        # while the synchronous job is restarting starts the restart over.
        spares=False,
    )

    def run(steps: int):
        return goodput_from_schedule(system, facts.kills, total_steps=steps, **common)

    if end_s is None and facts.capped:
        end_s = facts.window_s
    if end_s is not None:
        # Same window: the highest step the simulated run completes by end_s (a step later
        # rolled back and not redone by end_s still counts once, as in the timeline's
        # accounting). Its wall is monotone in the step count on a fixed schedule, so bisect.
        lo, hi, res = 0, facts.train_steps, None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            r = run(mid)
            if r.wall_s <= end_s:
                lo, res = mid, r
            else:
                hi = mid - 1
        steps, end = lo, end_s
        if res is None:
            return Prediction(system, 0.0, 0.0, end, 0, 0.0)
    else:
        res = run(facts.train_steps)
        steps, end = facts.train_steps, res.wall_s
    m = facts.num_learners
    # Sim units: the whole allocation stepping for step_s makes one step of every learner.
    productive = m * steps * facts.step_s
    allocated = m * end - _down_learner_s(facts, end)
    return Prediction(
        system=system,
        sim_goodput=res.goodput,
        sim_uptime=res.uptime,
        wall_s=res.wall_s,
        steps=steps,
        goodput=productive / allocated,
    )


HEADER = (
    "| run | mode → sim | M | kills | step s | restart s (n) | rejoin s (n) | start-up s "
    "| ckpt every | whole run: window | predicted | measured | diff (points) "
    "| until first learner done: window | predicted | measured | diff (points) "
    "| sim uptime | measured uptime |"
)


def row(name: str, facts: RunFacts, *, real_h: bool = False) -> str:
    """One markdown table row: the whole run (or its capped window), then the common window."""
    pred = predict(facts, real_h=real_h)
    whole = (
        f"cap {facts.window_s:.0f} s: {pred.steps:.0f} vs {facts.steps_done} steps"
        if facts.capped
        else f"to finish: {pred.wall_s:.0f} vs {facts.window_s:.0f} s"
    )
    cells = [whole, f"{pred.goodput:.3f}", f"{facts.goodput:.3f}"]
    cells.append(f"{100.0 * (pred.goodput - facts.goodput):+.1f}")
    if facts.first_done_s is not None and facts.goodput_first_done is not None:
        early = predict(facts, end_s=facts.first_done_s, real_h=real_h)
        cells += [
            f"{facts.first_done_s:.0f} s: {early.steps:.0f} steps sim",
            f"{early.goodput:.3f}",
            f"{facts.goodput_first_done:.3f}",
            f"{100.0 * (early.goodput - facts.goodput_first_done):+.1f}",
        ]
    else:
        cells += ["— (capped or synchronous)", "—", "—", "—"]
    head = [
        name,
        f"{facts.mode} → {pred.system}",
        str(facts.num_learners),
        str(len(facts.kills)),
        f"{facts.step_s:.3f}",
        f"{facts.restart_s:.1f} ({facts.restarts_measured})",
        f"{facts.rejoin_s:.1f} ({facts.rejoins_measured})",
        f"{facts.startup_s:.1f}",
        str(facts.checkpoint_every),
    ]
    # A capped prediction's uptime is over its own (shorter) run, not the window: not shown.
    tail = ["—" if facts.capped else f"{pred.sim_uptime:.3f}", f"{facts.uptime:.3f}"]
    return "| " + " | ".join(head + cells + tail) + " |"


def table(runs: Sequence[str | pathlib.Path], *, real_h: bool = False) -> list[str]:
    """The calibration table (markdown lines) for finished chaos run directories."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for path in runs:
        path = pathlib.Path(path)
        lines.append(row(f"{path.parent.name}/{path.name}", extract(path), real_h=real_h))
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: prints the calibration table for the given run directories."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished chaos run directories")
    parser.add_argument("--real_h", action="store_true", help="decoupled: H = sync period")
    args = parser.parse_args(argv)
    print("\n".join(table(args.runs, real_h=args.real_h)))


if __name__ == "__main__":
    main()
