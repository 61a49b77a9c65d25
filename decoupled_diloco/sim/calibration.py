"""Calibrates the goodput simulator against a finished local chaos run (issue 6).

`python -m decoupled_diloco.sim calibrate RUN_DIR [RUN_DIR ...]` reads each run (`sim.run_facts`:
the kill schedule, step, restart, rejoin and start-up times, checkpoint cadence, cost and commit
latency, all measured), feeds them to the simulator and prints predicted vs measured goodput.

Which model, and why (docs/simulator.md, "Calibration"):

* **decoupled runs: per-learner step budgets with checkpoint rollback**
  (`decoupled_diloco.sim.budgets`). Each learner must do its own `train_steps`; each kill loses
  exactly the steps since that learner's newest committed checkpoint at the kill time; the run
  ends when the last learner is done. The model writes timelines, and goodput is computed from
  them by `timeline.analyze`, the run's own definition, over the same window, so no
  re-expression is needed. `--pooled` uses the paper-scale engine instead (pooled work, an
  average loss of H/2 per kill with H := the checkpoint cadence, or the sync period with
  `--real_h`), the model used before, as a comparison.
* **dp and diloco runs: the dp engine** (`goodput_from_schedule("dp", ...)`), since a kill
  stops the whole job and it resumes from its last checkpoint. Its accounting is re-expressed in
  the run's definition, never tuned:
  - *Repair time is not billed* in the run (a dead machine is `down`, not allocated): the
    prediction is productive learner-time / (M x predicted wall - the learner-time the simulated
    learners spend down), the down time following the simulator's rule on the same schedule.
  - *A run stopped at its time cap* (dp/diloco in the chaos benchmark) is compared over the same
    window: the largest step count the simulated job completes by the cap, over the same window.
  - *No spare machine*: the killed learner itself is restarted, so `spares=False`.
* **The one-time start of the run** is passed as `startup_s` (measured: each learner's first
  record to its first counted step, averaged), so both sides bill it.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence

from decoupled_diloco.obs import timeline as timeline_lib
from decoupled_diloco.sim import goodput_from_schedule
from decoupled_diloco.sim.budgets import budget_result, budget_timelines, window
from decoupled_diloco.sim.run_facts import RunFacts, extract

__all__ = ["HEADER", "Prediction", "RunFacts", "extract", "predict", "row", "table"]


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
    """The simulator's goodput for a run, in the sim's and in the run's definition.

    For the per-learner model the two are the same (it is computed by the run's definition);
    `steps` is then the mean number of step indices a learner has executed in the window,
    `lost_steps` the steps executed again after a rollback, and `kills_hit` the kills that found
    their learner up (the others are refused: down, or already done).
    """

    system: str
    sim_goodput: float
    sim_uptime: float
    wall_s: float
    steps: float
    goodput: float
    lost_steps: int | None = None
    kills_hit: int | None = None


def predict(
    facts: RunFacts, *, end_s: float | None = None, pooled: bool = False, real_h: bool = False
) -> Prediction:
    """Feeds `facts` to the simulator; the goodput is in the run's definition (module doc).

    Args:
        facts: From `extract`.
        end_s: Compare over [0, end_s] instead of the whole run (default: the cap of a capped
            run, else the whole run).
        pooled: Decoupled only: the paper-scale pooled engine instead of per-learner budgets.
        real_h: With `pooled`: pass the run's sync period as H instead of the checkpoint cadence.
    """
    if facts.mode == "decoupled" and not (pooled or real_h):
        return _predict_budgets(facts, end_s)
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


def _predict_budgets(facts: RunFacts, end_s: float | None) -> Prediction:
    """A decoupled run by `sim.budgets`: simulated timelines, measured like the run's."""
    timelines = budget_timelines(
        facts.kills,
        num_learners=facts.num_learners,
        steps=facts.train_steps,
        step_s=facts.step_s,
        startup_s=facts.startup_s,
        restart_s=facts.restart_s,
        rejoin_s=facts.rejoin_s,
        checkpoint_every=facts.checkpoint_every,
        checkpoint_s=facts.checkpoint_s,
        commit_s=facts.commit_s,
    )
    whole = budget_result(timelines)
    if end_s is not None:
        timelines = window(timelines, end_s)
    stats = timeline_lib.analyze(timelines, t_end=whole.wall_s if end_s is None else end_s)
    executed = [
        len({r.step for r in recs if r.state in timeline_lib.STEP_STATES})
        for recs in timelines.values()
    ]
    return Prediction(
        system="budgets",
        sim_goodput=stats.goodput,
        sim_uptime=stats.uptime,
        wall_s=whole.wall_s,
        steps=sum(executed) / len(executed),
        goodput=stats.goodput,
        lost_steps=stats.lost_steps,
        kills_hit=sum(r.state == "down" for recs in timelines.values() for r in recs),
    )


HEADER = (
    "| run | mode → sim | M | kills | step s | restart s (n) | rejoin s (n) | start-up s "
    "| ckpt every | whole run: window | predicted | measured | diff (points) "
    "| until first learner done: window | predicted | measured | diff (points) "
    "| sim uptime | measured uptime |"
)


def row(name: str, facts: RunFacts, *, pooled: bool = False, real_h: bool = False) -> str:
    """One markdown table row: the whole run (or its capped window), then the common window."""
    pred = predict(facts, pooled=pooled, real_h=real_h)
    whole = (
        f"cap {facts.window_s:.0f} s: {pred.steps:.0f} vs {facts.steps_done} steps"
        if facts.capped
        else f"to finish: {pred.wall_s:.0f} vs {facts.window_s:.0f} s"
    )
    cells = [whole, f"{pred.goodput:.3f}", f"{facts.goodput:.3f}"]
    cells.append(f"{100.0 * (pred.goodput - facts.goodput):+.1f}")
    if facts.first_done_s is not None and facts.goodput_first_done is not None:
        early = predict(facts, end_s=facts.first_done_s, pooled=pooled, real_h=real_h)
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


def table(
    runs: Sequence[str | pathlib.Path], *, pooled: bool = False, real_h: bool = False
) -> list[str]:
    """The calibration table (markdown lines) for finished chaos run directories."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for path in runs:
        path = pathlib.Path(path)
        name = f"{path.parent.name}/{path.name}"
        lines.append(row(name, extract(path), pooled=pooled, real_h=real_h))
    return lines
