"""Decoupled learners with fixed step budgets and checkpoint rollback: the calibration model.

The paper-scale engine (`engines.simulate_decoupled`) pools the work of all learners and charges
each failure an average loss; that is the right model for a 1T-token run whose learners are
elastic and interchangeable, and it stays the default. A local chaos run differs in two ways that
are deterministic consequences of its inputs, so the schedule-driven calibration models them
exactly instead (docs/simulator.md, "Calibration"):

* **Each learner has its own step budget** (`train_steps`) and is released when it has done it.
  A learner that lost time to kills finishes late, and a kill that lands in that tail costs the
  run, whereas the pooled engine, which ends when the summed work is done, never sees it.
* **A kill loses exactly the steps since the learner's last durable checkpoint.** The learner
  checkpoints after every `checkpoint_every`-th step and after its last one; the save is
  asynchronous, so a checkpoint started at time t is on disk (and restorable) only from
  t + `commit_s`. A kill restores the newest durable checkpoint and re-executes every step after
  it, which, given the kill time, the step time and the learner's restart history, is one
  number, not the C/2 average.

The model writes each learner's states as `decoupled_diloco.obs.timeline` records (the format a real
run writes), so goodput and uptime come from `timeline.analyze`, the same function, the same
definitions and the same window as the run's own measurement. It loops over steps (hundreds per
learner), which is fine for calibration and not meant for a million chips.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from decoupled_diloco.obs.timeline import Record, analyze
from decoupled_diloco.sim.engines import SystemResult


def learner_timeline(
    kills: Sequence[float],
    *,
    steps: int,
    step_s: float,
    startup_s: float,
    restart_s: float,
    rejoin_s: float,
    checkpoint_every: int = 0,
    checkpoint_s: float = 0.0,
    commit_s: float | None = None,
) -> list[Record]:
    """The timeline of one learner that must do `steps` steps while being killed at `kills`.

    Mirrors the learner's loop (decoupled_diloco/learner.py): a (re)start spends `startup_s`
    (the first one) or `rejoin_s` (after a kill) from its `starting` record to its first
    `stepping` record, and that time includes the compiling step, which completes step
    `restored + 1`; then one `stepping` record of `step_s` per step; after each step k with
    k % checkpoint_every == 0, or k == steps, a `checkpointing` record of `checkpoint_s`, the
    checkpoint becoming durable `commit_s` after it starts; `done` after the last step's
    checkpoint. A kill while the learner is up (starting, stepping or checkpointing) writes `down`
    for `restart_s` (not billed by the run), then `starting` again, and the learner resumes from
    its newest durable checkpoint (step 0 if none). A kill while it is down or done does nothing,
    as the supervisor refuses it.

    Why the compiling record sits `step_s` before the first `stepping` one: the compiling step is
    never productive, so where it sits inside the rejoin changes no goodput; placing it last
    keeps every record inside the measured rejoin time.

    Args:
        kills: Times of the kills of this learner, seconds from the run's start.
        steps: The learner's step budget.
        step_s: Time of one step.
        startup_s: The first start: first record to first `stepping` record.
        restart_s: Kill to the process being started again (time `down`).
        rejoin_s: Restarted process to its first `stepping` record.
        checkpoint_every: Checkpoint cadence in steps; 0: no checkpoints (a kill restarts at 0).
        checkpoint_s: Duration of a `checkpointing` record (the blocking part of a save).
        commit_s: Time from a checkpoint's start to its being durable; default `checkpoint_s`.

    Returns:
        The learner's records, in time order.
    """
    if steps < 1 or step_s <= 0:
        raise ValueError(f"need steps >= 1 and step_s > 0, got steps={steps}, step_s={step_s}")
    commit_s = checkpoint_s if commit_s is None else commit_s
    pending = sorted(float(t) for t in kills)
    records = [Record(0.0, "starting")]
    durable: list[tuple[float, int]] = []  # (durable from, step) of checkpoints on disk
    up_at, join_s, restored = 0.0, startup_s, 0

    def due(k: int) -> bool:
        return k == steps or (checkpoint_every > 0 and k % checkpoint_every == 0)

    while True:
        while pending and pending[0] < up_at:
            pending.pop(0)  # the learner is down: the supervisor refuses the kill
        kill = pending.pop(0) if pending else math.inf
        # One incarnation as if nothing killed it, then cut at `kill`.
        t = up_at + join_s
        trace: list[Record] = []
        started: list[tuple[float, int]] = []  # (durable from, step) of its checkpoints
        if restored < steps:
            trace.append(Record(max(up_at, t - step_s), "compiling", restored + 1))
            for k in range(restored + 1, steps + 1):
                if k > restored + 1:
                    trace.append(Record(t, "stepping", k))
                    t += step_s
                if due(k):
                    trace.append(Record(t, "checkpointing", k))
                    started.append((t + commit_s, k))
                    t += checkpoint_s
        trace.append(Record(t, "done"))
        if kill >= t:  # the budget is done first; a later kill is refused (finished)
            return records + trace
        records += [r for r in trace if r.t < kill]
        records.append(Record(kill, "down"))
        durable += [(at, k) for at, k in started if at <= kill]
        restored = durable[-1][1] if durable else 0
        up_at, join_s = kill + restart_s, rejoin_s
        records.append(Record(up_at, "starting"))


def budget_timelines(
    failures: Sequence[tuple[float, int]],
    *,
    num_learners: int,
    steps: int,
    step_s: float,
    startup_s: float,
    restart_s: float,
    rejoin_s: float,
    checkpoint_every: int = 0,
    checkpoint_s: float = 0.0,
    commit_s: float | None = None,
) -> dict[int, list[Record]]:
    """Every learner's `learner_timeline` for `(time_s, learner)` kills (arguments as there).

    Learners are independent given the schedule: a decoupled learner never waits for another
    (the syncer closes rounds with whoever pushes), so one learner's kill does not move another's
    timeline.
    """
    for _, learner in failures:
        if not 0 <= learner < num_learners:
            raise ValueError(f"learner {learner} out of range [0, {num_learners})")
    return {
        m: learner_timeline(
            [t for t, who in failures if who == m],
            steps=steps,
            step_s=step_s,
            startup_s=startup_s,
            restart_s=restart_s,
            rejoin_s=rejoin_s,
            checkpoint_every=checkpoint_every,
            checkpoint_s=checkpoint_s,
            commit_s=commit_s,
        )
        for m in range(num_learners)
    }


def window(timelines: dict[int, list[Record]], end_s: float) -> dict[int, list[Record]]:
    """The records up to `end_s`: what a run's timelines hold if it is cut there."""
    return {m: [r for r in recs if r.t <= end_s] for m, recs in timelines.items()}


def budget_result(timelines: dict[int, list[Record]]) -> SystemResult:
    """Goodput and uptime of simulated timelines, by the run's own definitions (module doc).

    `wall_s` is when the last learner is done; `interruptions` counts kills that took an up
    learner down; `lost["rolled_back"]` is the share of allocated time spent on steps that were
    executed again later.
    """
    end = max(recs[-1].t for recs in timelines.values())
    stats = analyze(timelines, t_end=end)
    allocated = sum(s.allocated_s for s in stats.learners.values())
    stepping = sum(s.by_state.get("stepping", 0.0) for s in stats.learners.values())
    productive = sum(s.productive_s for s in stats.learners.values())
    return SystemResult(
        system="decoupled",
        goodput=stats.goodput,
        uptime=stats.uptime,
        wall_s=end,
        interruptions=sum(r.state == "down" for recs in timelines.values() for r in recs),
        lost={"rolled_back": (stepping - productive) / allocated if allocated > 0 else 0.0},
    )
