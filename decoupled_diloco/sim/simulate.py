"""Entry points: simulate one configuration, sweep chip counts, or replay an explicit schedule."""

import dataclasses
from collections.abc import Iterable, Sequence

from decoupled_diloco.sim.analytic import estimate_goodput
from decoupled_diloco.sim.budgets import budget_result, budget_timelines
from decoupled_diloco.sim.config import SYSTEMS, SimConfig
from decoupled_diloco.sim.engines import ENGINES, HorizonTooShortError, SystemResult
from decoupled_diloco.sim.failures import FailureSchedule, explicit_schedule, poisson_schedule

MAX_HORIZON_FACTOR = 1000.0  # give up when a run would take 1000x its failure-free time


def run_on_schedule(cfg: SimConfig, system: str, schedule: FailureSchedule) -> SystemResult:
    """Runs one system on a given schedule.

    Raises:
        HorizonTooShortError: If the run does not finish within `schedule.horizon_s`.
        ValueError: If `system` is unknown.
    """
    if system not in ENGINES:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    return ENGINES[system](cfg, schedule)


def simulate(cfg: SimConfig, systems: Iterable[str] = SYSTEMS) -> dict[str, SystemResult]:
    """Simulates the full token budget for each system on one random failure schedule.

    Every system replays the same schedule (common random numbers). The schedule is drawn up to a
    horizon sized from the closed-form estimates, and redrawn twice as long (same seed, so the
    shared prefix is identical) if some system has not finished by then.

    Args:
        cfg: Configuration.
        systems: Which of "dp", "elastic_dp", "decoupled" to run.

    Returns:
        Results keyed by system name.

    Raises:
        ValueError: If some system would need more than 1000x the ideal time (goodput < 0.1%).
    """
    systems = list(systems)
    worst = min(max(estimate_goodput(cfg, s), 0.02) for s in systems)
    horizon = cfg.startup_s + 1.25 * cfg.ideal_s / worst
    schedule = poisson_schedule(cfg, horizon)
    results = {}
    for system in systems:
        while True:
            try:
                results[system] = run_on_schedule(cfg, system, schedule)
                break
            except HorizonTooShortError:
                horizon *= 2.0
                if horizon > MAX_HORIZON_FACTOR * cfg.ideal_s + cfg.startup_s:
                    # Why a cap: a system that (almost) never finishes would double the schedule
                    # until memory runs out; below 0.1% goodput the number is meaningless anyway.
                    raise ValueError(
                        f"{system} has goodput below {1 / MAX_HORIZON_FACTOR:.1%} for {cfg}"
                    ) from None
                schedule = poisson_schedule(cfg, horizon)
    return results


def sweep(
    base: SimConfig, chips: Sequence[int], learners: Sequence[int]
) -> list[dict[str, float | int | str]]:
    """Goodput and uptime of every system over chip counts and (for decoupled) learner counts.

    Returns:
        One row per (chips, system, M): keys chips, system, learners, goodput, uptime.
    """
    rows: list[dict[str, float | int | str]] = []
    for n in chips:
        cfg = dataclasses.replace(base, num_chips=int(n))
        for system, res in simulate(cfg, ("dp", "elastic_dp")).items():
            rows.append(_row(n, system, 1, res))
        for m in learners:
            res = simulate(dataclasses.replace(cfg, num_learners=int(m)), ("decoupled",))
            rows.append(_row(n, "decoupled", m, res["decoupled"]))
    return rows


def _row(chips: int, system: str, learners: int, res: SystemResult) -> dict[str, float | int | str]:
    return {
        "chips": int(chips),
        "system": system,
        "learners": int(learners),
        "goodput": res.goodput,
        "uptime": res.uptime,
    }


def goodput_from_schedule(
    system: str,
    failures: Sequence[tuple[float, int]],
    *,
    num_learners: int,
    total_steps: int,
    step_s: float,
    restart_s: float,
    rejoin_s: float,
    reconfigure_s: float | None = None,
    checkpoint_every_steps: int = 0,
    checkpoint_s: float = 0.0,
    sync_every_steps: int = 24,
    startup_s: float = 0.0,
    quorum: int = 1,
    spares: bool = True,
    step_budgets: bool = False,
    checkpoint_commit_s: float | None = None,
) -> SystemResult:
    """Predicts the goodput of a small run from its explicit failure schedule (calibration hook).

    Meant for a local chaos run: M learners, each one process (one "slice" here), and a list of
    `(time_s, learner)` kills. A killed learner is back after `restart_s` (process restart) and
    trains again `rejoin_s` later (restore or fetch state, compile). For `dp` the whole job stops
    for `restart_s + rejoin_s` and resumes from its last checkpoint; for `elastic_dp` the survivors
    pause `reconfigure_s` (default `rejoin_s`) to drop or re-add the learner.

    Args:
        system: "dp", "elastic_dp" or "decoupled".
        failures: `(time_s, learner_id)` pairs, learner ids in [0, num_learners).
        num_learners: M.
        total_steps: Steps of the run (at full size; learners share the global batch).
        step_s: Measured time of one step.
        restart_s: Measured time from a kill until the process is back.
        rejoin_s: Measured time from being back until training again.
        reconfigure_s: Pause of the survivors in elastic DP; default `rejoin_s`.
        checkpoint_every_steps: DP checkpoint interval (0: Daly optimum, meaningless here).
        checkpoint_s: DP checkpoint cost.
        sync_every_steps: H of the decoupled run.
        startup_s: Start-up time before the first step.
        quorum: K of the decoupled run.
        spares: DP only: whether a restart swaps in a spare for the failed learner. A local
            chaos run has none (the killed learner itself is restarted), so a kill during a
            restart starts it over; pass False there.
        step_budgets: Decoupled only: simulate each learner with its own budget of
            `total_steps` steps and exact checkpoint rollback (`sim.budgets`, the model the
            calibration uses) instead of pooling the learners' work with an average loss per
            failure (the paper-scale engine, the default). Goodput is then in the chaos run's
            own definition (down time not billed, a learner released when done).
        checkpoint_commit_s: With `step_budgets`: time from a checkpoint's start until it can
            be restored (asynchronous save); default `checkpoint_s`.

    Returns:
        The simulated result; `goodput` is comparable to the chaos run's measured goodput.
    """
    if step_budgets:
        if system != "decoupled":
            raise ValueError(f"step_budgets applies to decoupled runs only, not {system!r}")
        timelines = budget_timelines(
            failures,
            num_learners=num_learners,
            steps=total_steps,
            step_s=step_s,
            startup_s=startup_s,
            restart_s=restart_s,
            rejoin_s=rejoin_s,
            checkpoint_every=checkpoint_every_steps,
            checkpoint_s=checkpoint_s,
            commit_s=checkpoint_commit_s,
        )
        return budget_result(timelines)
    reconfigure_s = rejoin_s if reconfigure_s is None else reconfigure_s
    cfg = SimConfig(
        num_chips=num_learners,
        slice_chips=1,
        slice_return_s=restart_s,
        total_tokens=float(total_steps),
        tokens_per_step=1.0,
        step_s=step_s,
        startup_s=startup_s,
        checkpoint_s=checkpoint_s,
        checkpoint_every_steps=checkpoint_every_steps
        if checkpoint_every_steps > 0
        else total_steps,
        restart_s=restart_s + rejoin_s,
        # A learner process has no slice left when killed: it is away until it is back
        # (slice_return_s) and re-added (upscale_s); elastic survivors pause reconfigure_s.
        downscale_s=0.0 if system == "decoupled" else reconfigure_s,
        upscale_s=rejoin_s if system == "decoupled" else reconfigure_s,
        num_learners=num_learners,
        quorum=quorum,
        sync_every_steps=sync_every_steps,
        dp_spares=spares,
    )
    for _, learner in failures:
        if not 0 <= learner < num_learners:
            raise ValueError(f"learner {learner} out of range [0, {num_learners})")
    return run_on_schedule(cfg, system, explicit_schedule(list(failures)))
