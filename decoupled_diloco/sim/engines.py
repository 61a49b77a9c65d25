"""Event-driven engines for the three systems, replaying one failure schedule.

Work is measured in *ideal seconds*: one second of the whole allocation (every slice up, mean-speed
chips) training at full rate. The run ends when the preserved work reaches `cfg.ideal_s`, so
goodput = ideal_s / wall_s = useful chip-time / allocated chip-time.

The engines loop over failure and return *events* (tens of thousands for a 2.4M-chip, 1T-token
run), never over chips or steps; per-event state is a handful of floats.
"""

import collections
import dataclasses
import math

import numpy as np

from decoupled_diloco.sim.config import (
    SimConfig,
    checkpoint_every_steps,
    straggler_slowdown,
)
from decoupled_diloco.sim.failures import FailureSchedule, learner_of_slice


class HorizonTooShortError(Exception):
    """The schedule ends before the run does; the caller draws a longer one and retries."""


@dataclasses.dataclass(frozen=True)
class SystemResult:
    """Outcome of one system on one schedule.

    Attributes:
        system: "dp", "elastic_dp" or "decoupled".
        goodput: Preserved useful chip-time / allocated chip-time.
        uptime: Fraction of wall time during which training steps advance (for decoupled: at
            least `quorum` learners are running, so the syncer can close rounds).
        wall_s: Wall-clock to consume the token budget.
        interruptions: Failures that hit a slice that was up; for dp, failures that forced a
            restart (those arriving during a restart are absorbed by it).
        lost: Work done and then thrown away, by cause, as a fraction of allocated chip-time
            (losses are losses of preserved work only; pauses and capacity away are not listed).
    """

    system: str
    goodput: float
    uptime: float
    wall_s: float
    interruptions: int
    lost: dict[str, float]


@dataclasses.dataclass(frozen=True)
class GroupTrace:
    """Piecewise-linear preserved work of one elastic group (elastic DP job, or one learner).

    Between breakpoints k and k+1 the work is `work[k] + rate[k] * (t - t[k])`; losses are jumps.
    `interrupt_t` holds the times of failures that hit a slice that was up.
    """

    t: np.ndarray
    work: np.ndarray
    rate: np.ndarray
    interrupt_t: np.ndarray
    lost_partial: float
    lost_stale: float


def simulate_dp(cfg: SimConfig, schedule: FailureSchedule) -> SystemResult:
    """Synchronous data-parallel job: any failure stops everyone, restart from the last checkpoint.

    Modelling choices (see docs/simulator.md): the job always runs at full size, because a restart
    swaps spare slices in for failed ones; failures that arrive during a restart are absorbed by
    it (the restart re-forms the job from whatever is healthy when it completes); a failure during
    a checkpoint write loses that checkpoint; the final step needs no checkpoint. With
    `cfg.dp_spares` False there is no spare: a failure during a restart starts it over.
    """
    every = checkpoint_every_steps(cfg)
    step_s = cfg.step_s * straggler_slowdown(cfg.num_slices * cfg.slice_chips, cfg)
    segment_s = every * step_s + cfg.checkpoint_s
    times = schedule.times_s
    t = cfg.startup_s
    committed = 0.0  # steps safe in a checkpoint
    idx = int(np.searchsorted(times, t, side="right"))
    restarts = 0
    running_s = 0.0
    rolled_back_steps = 0.0
    while True:
        remaining = cfg.total_steps - committed
        finish = (
            t + remaining * step_s + max(0, math.ceil(remaining / every) - 1) * cfg.checkpoint_s
        )
        fail = float(times[idx]) if idx < times.size else math.inf
        if finish <= fail:
            if finish > schedule.horizon_s:
                raise HorizonTooShortError
            running_s += remaining * step_s
            break
        if fail > schedule.horizon_s:
            raise HorizonTooShortError
        up_s = fail - t
        full = math.floor(up_s / segment_s)
        committed += full * every
        partial_s = min(up_s - full * segment_s, every * step_s)
        running_s += full * every * step_s + partial_s
        rolled_back_steps += partial_s / step_s
        restarts += 1
        t = fail + cfg.restart_s
        idx = int(np.searchsorted(times, t, side="right"))  # absorbs failures during the restart
        if not cfg.dp_spares:
            # No spare to swap in: a failure during the restart kills it, and it starts over once
            # that slice is back, so the restart ends restart_s after the last failure inside it.
            while times[idx - 1] > fail:
                fail = float(times[idx - 1])
                t = fail + cfg.restart_s
                idx = int(np.searchsorted(times, t, side="right"))
    return SystemResult(
        system="dp",
        goodput=cfg.ideal_s / finish,
        uptime=running_s / finish,
        wall_s=finish,
        interruptions=restarts,
        lost={"rolled_back": rolled_back_steps * cfg.step_s / finish},
    )


def stale_loss_steps(away_steps: float, sync_every_steps: int) -> float:
    """Steps of a learner's pre-failure work dropped because rounds closed while it was away.

    Why: fragments are synced staggered, a fraction 1/H of them becoming due each step. A fragment
    due x steps after the failure had H - x steps of this learner's progress not yet pushed; the
    syncer closes that round without the dead learner (quorum from the others; late pushes are
    dropped) and the merged fragment then overwrites the learner's copy when it rejoins. Each
    fragment is 1/P of the model and 1/H of fragments fall due per step, so the loss in
    full-model steps is the integral of (H - x) / H over x in [0, min(away, H)]:
    D - D^2 / (2H). It is bounded by H/2: a learner is never staler than one sync period.

    Args:
        away_steps: Time from failure to running again, in steps.
        sync_every_steps: H.

    Returns:
        Lost work in steps of the learner (at its pre-failure size).
    """
    d = min(max(away_steps, 0.0), float(sync_every_steps))
    return d - d * d / (2.0 * sync_every_steps)


def simulate_group(
    cfg: SimConfig,
    times_s: np.ndarray,
    local_slices: np.ndarray,
    group_slices: int,
    horizon_s: float,
    *,
    is_learner: bool,
) -> GroupTrace:
    """One elastic group: drops failed slices, re-adds returned ones, pausing to reconfigure.

    Used for the whole elastic DP job (one group of every slice) and for each decoupled learner.
    A pause is fixed-length and absorbs the membership changes that arrive before it ends (the
    group is re-formed from whatever is healthy at that moment), which is also why a failure
    during a pause costs nothing extra. A failure while running loses the step in flight; for a
    learner it also loses the progress dropped by rounds that close while it is away
    (`stale_loss_steps`), unless `cfg.salvage_on_failure`.

    Args:
        cfg: Configuration.
        times_s: Failure times hitting this group, sorted.
        local_slices: Slice index within the group of each failure.
        group_slices: Slices in the group.
        horizon_s: Failures are known up to here; the trace stops there.
        is_learner: Whether this group is a decoupled learner (staleness applies).

    Returns:
        The group's preserved-work trace up to `horizon_s`.
    """
    slowdown = straggler_slowdown(group_slices * cfg.slice_chips, cfg)
    step_s = cfg.step_s * slowdown
    per_slice_rate = 1.0 / (cfg.num_slices * slowdown)  # ideal seconds per second per slice
    upscale_s = cfg.upscale_switch_s if cfg.background_upscale else cfg.upscale_s
    # Rounds close without this learner only if the others can make quorum; with M = 1 they wait.
    charge_stale = is_learner and not cfg.salvage_on_failure and cfg.num_learners - 1 >= cfg.quorum
    down_until = [0.0] * group_slices
    returns: collections.deque[float] = collections.deque()  # fixed return time => FIFO order
    up = group_slices
    work = 0.0
    rate = 0.0
    t = 0.0
    running = False
    paused_until = cfg.startup_s
    run_start = 0.0
    bp_t, bp_w, bp_r = [0.0], [0.0], [0.0]
    fail_t, fail_s = times_s.tolist(), local_slices.tolist()
    i, n_fail = 0, len(fail_t)
    interrupt_t: list[float] = []
    lost_partial, lost_stale = 0.0, 0.0
    while True:
        tf = fail_t[i] if i < n_fail else math.inf
        tr = returns[0] if returns else math.inf
        te = min(tf, tr)
        if not running and paused_until <= min(te, horizon_s):
            running, run_start, t = True, paused_until, paused_until
            rate = up * per_slice_rate
            bp_t.append(t), bp_w.append(work), bp_r.append(rate)
        if te > horizon_s or te == math.inf:
            break
        if running:
            work += rate * (te - t)
        t = te
        if tf <= tr:
            s = fail_s[i]
            i += 1
            if down_until[s] > te:
                continue  # the slice is already down: nothing changes
            down_until[s] = te + cfg.slice_return_s
            returns.append(te + cfg.slice_return_s)
            up -= 1
            interrupt_t.append(te)
            if not running:
                continue  # absorbed by the pause in progress
            partial = rate * ((te - run_start) % step_s)
            stale = 0.0
            if charge_stale:
                away_s = cfg.downscale_s
                if up == 0:  # no slice left: away until one returns and is re-added
                    away_s = max(cfg.downscale_s, returns[0] - te) + upscale_s
                stale = rate * step_s * stale_loss_steps(away_s / step_s, cfg.sync_every_steps)
            work -= partial + stale
            lost_partial += partial
            lost_stale += stale
            paused_until = te + cfg.downscale_s
        else:
            returns.popleft()
            up += 1
            if not running:
                continue  # joins when the pause in progress ends
            # A planned pause: the group finishes its step and (for a learner) pushes what is due
            # before pausing, so nothing is lost.
            paused_until = te + upscale_s
        running, rate = False, 0.0
        bp_t.append(te), bp_w.append(work), bp_r.append(0.0)
    return GroupTrace(
        t=np.asarray(bp_t),
        work=np.asarray(bp_w),
        rate=np.asarray(bp_r),
        interrupt_t=np.asarray(interrupt_t),
        lost_partial=lost_partial,
        lost_stale=lost_stale,
    )


def _finish_time(traces: list[GroupTrace], budget: float, horizon_s: float) -> float:
    """First time the summed preserved work of all groups reaches `budget`."""
    grid = np.unique(np.concatenate([tr.t for tr in traces]))
    value = np.zeros_like(grid)
    slope = np.zeros_like(grid)
    for tr in traces:
        k = np.searchsorted(tr.t, grid, side="right") - 1  # right-continuous: after any jump
        value += tr.work[k] + tr.rate[k] * (grid - tr.t[k])
        slope += tr.rate[k]
    seg_end = np.append(grid[1:], horizon_s)
    # 0 * inf would be nan: a flat last segment reaches nothing more.
    gain = np.where(slope > 0, slope * (seg_end - grid), 0.0)
    reached = value + gain >= budget * (1.0 - 1e-12)
    if not reached.any():
        raise HorizonTooShortError
    q = int(np.argmax(reached))
    if value[q] >= budget:
        return float(grid[q])
    return float(grid[q] + (budget - value[q]) / slope[q])


def _running_fraction(traces: list[GroupTrace], min_running: int, end_s: float) -> float:
    """Fraction of [0, end_s] during which at least `min_running` groups have a positive rate."""
    times, deltas = [], []
    for tr in traces:
        on = (tr.rate > 0).astype(np.int64)
        change = np.diff(on, prepend=0)
        nz = change != 0
        times.append(tr.t[nz])
        deltas.append(change[nz])
    t_all = np.concatenate(times)
    d_all = np.concatenate(deltas)
    order = np.argsort(t_all, kind="stable")
    t_all, count = t_all[order], np.cumsum(d_all[order])
    edges = np.append(np.clip(t_all, 0.0, end_s), end_s)
    durations = np.diff(edges)
    return float(durations[count >= min_running].sum() / end_s)


def simulate_elastic_dp(cfg: SimConfig, schedule: FailureSchedule) -> SystemResult:
    """One synchronous job that drops failed slices and re-adds them, pausing globally each time."""
    trace = simulate_group(
        cfg,
        schedule.times_s,
        schedule.slice_ids,
        cfg.num_slices,
        schedule.horizon_s,
        is_learner=False,
    )
    end = _finish_time([trace], cfg.ideal_s, schedule.horizon_s)
    return SystemResult(
        system="elastic_dp",
        goodput=cfg.ideal_s / end,
        uptime=_running_fraction([trace], 1, end),
        wall_s=end,
        interruptions=_count_before([trace], end),
        lost={"in_flight_step": trace.lost_partial / end},
    )


def simulate_decoupled(cfg: SimConfig, schedule: FailureSchedule) -> SystemResult:
    """M elastic learners that never wait for each other; a failure pauses only its learner.

    Learners are independent given the schedule (quorum K only gates whether the syncer can close
    rounds, which is what uptime reports); the run ends when their summed work reaches the budget.
    """
    owner = learner_of_slice(cfg.num_slices, cfg.num_learners)
    first_slice = np.searchsorted(owner, np.arange(cfg.num_learners))
    sizes = np.bincount(owner, minlength=cfg.num_learners)
    hit = owner[schedule.slice_ids]
    traces = []
    for m in range(cfg.num_learners):  # a loop over learners (<= tens), not chips
        mine = hit == m
        traces.append(
            simulate_group(
                cfg,
                schedule.times_s[mine],
                schedule.slice_ids[mine] - first_slice[m],
                int(sizes[m]),
                schedule.horizon_s,
                is_learner=True,
            )
        )
    end = _finish_time(traces, cfg.ideal_s, schedule.horizon_s)
    return SystemResult(
        system="decoupled",
        goodput=cfg.ideal_s / end,
        uptime=_running_fraction(traces, cfg.quorum, end),
        wall_s=end,
        interruptions=_count_before(traces, end),
        lost={
            "in_flight_step": sum(tr.lost_partial for tr in traces) / end,
            "stale_rounds": sum(tr.lost_stale for tr in traces) / end,
        },
    )


def _count_before(traces: list[GroupTrace], end_s: float) -> int:
    """Interruptions up to `end_s` (the traces themselves run on to the schedule's horizon)."""
    return int(sum(np.count_nonzero(tr.interrupt_t <= end_s) for tr in traces))


ENGINES = {
    "dp": simulate_dp,
    "elastic_dp": simulate_elastic_dp,
    "decoupled": simulate_decoupled,
}
