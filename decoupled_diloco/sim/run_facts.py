"""Reads a finished local chaos run into what the goodput simulator needs (`sim.calibration`).

`extract(RUN_DIR)` reads the run's timelines (`timeline/*.jsonl`), fault events
(`metrics.jsonl`), config and checkpoint directory, and returns `RunFacts`: the kill schedule,
the mean step time, the restart time (kill -> process back), the rejoin time (process start ->
first step that counts: starting + restoring + compiling), the one-time start-up, the checkpoint
cadence, cost and commit latency, and the measured goodput (timeline definition, not recomputed
differently here). Every number is measured; none is fitted to the measured goodput.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from decoupled_diloco.obs import timeline as timeline_lib

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
        kills: `(time_s, learner)` of every kill injected, timed by its `down` record
            (`_kill_time`).
        step_s: Mean step time, over runs of steps the learner ended itself (`_closed_step_runs`).
        restart_s: Mean time from a kill to the process being started again.
        rejoin_s: Mean time from a restart to the first `stepping` record after it.
        startup_s: Mean time from each learner's first record to its first `stepping` record.
        checkpoint_s: Mean duration of a `checkpointing` record.
        commit_s: Mean time from a `checkpointing` record's start to its checkpoint being
            committed on disk (`_commit_latencies`); None where no checkpoint is left to time.
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
    commit_s: float | None = None


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


def _kill_time(records: Sequence[timeline_lib.Record], event_t: float) -> float:
    """When a kill happened: its learner's latest `down` record at or before the fault event.

    Why not the event's own time: the supervisor writes `down` with the time it takes just
    before sending SIGKILL, and the injector logs the fault event only after the process has
    been reaped, 0.2-0.6 s later in the chaos runs. Whether a kill finds the newest checkpoint
    committed turns on fractions of a second, so the kill is timed where it happened. Falls back
    to the event time where no `down` record is within 5 s before it.
    """
    downs = [r.t for r in records if r.state == "down" and event_t - 5.0 <= r.t <= event_t]
    return max(downs) if downs else event_t


def _commit_latencies(
    run: pathlib.Path, records: dict[int, list[timeline_lib.Record]]
) -> list[float]:
    """Seconds from each surviving checkpoint's `checkpointing` record to its commit on disk.

    Saves are asynchronous: Orbax writes `STEP/commit_success.txt` when the checkpoint is
    complete, and only then can a restart restore it. Its modification time, minus the start of
    the learner's last `checkpointing` record of that step before it, is the commit latency.
    Only the checkpoints the run kept (`checkpoint.max_to_keep` per learner, the last ones) can
    be timed.
    """
    out = []
    for directory in sorted((run / "checkpoints").glob("learner_*")):
        learner = directory.name.removeprefix("learner_")
        if not directory.is_dir() or not learner.isdigit():
            continue
        for step_dir in directory.iterdir():
            marker = step_dir / "commit_success.txt"
            if not step_dir.name.isdigit() or not marker.exists():
                continue
            committed = marker.stat().st_mtime
            starts = [
                r.t
                for r in records.get(int(learner), [])
                if r.state == "checkpointing" and r.step == int(step_dir.name) and r.t <= committed
            ]
            if starts:
                out.append(committed - max(starts))
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
        (_kill_time(records.get(int(e["learner"]), []), float(e["time"])) - t0, int(e["learner"]))
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

    commits = _commit_latencies(run, records)
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
        commit_s=sum(commits) / len(commits) if commits else None,
        window_s=t_end - t0,
        capped=capped,
        goodput=measured.goodput,
        uptime=measured.uptime,
        restarts_measured=len(restarts),
        rejoins_measured=len(rejoins),
        first_done_s=first_done_s,
        goodput_first_done=goodput_first_done,
    )
