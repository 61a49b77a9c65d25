"""Closed-form goodput approximations, used to size the simulated horizon and to check the engines.

They share the engines' assumptions (exponential failures, fixed-length pauses that absorb the
events arriving during them) but ignore second-order effects the engines capture: several slices
down at once, overlapping pauses, and the last, partial checkpoint interval.
"""

import math

from decoupled_diloco.sim.config import SimConfig, checkpoint_every_steps, straggler_slowdown
from decoupled_diloco.sim.engines import stale_loss_steps


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum checkpoint interval sqrt(2 c MTBF)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def dp_goodput_first_order(cfg: SimConfig) -> float:
    """Young/Daly first-order DP goodput 1 - sqrt(2 c lambda) - lambda R.

    At Young's interval T, the waste per unit time is c/T (checkpoints) + lambda T / 2 (rework)
    + lambda R (restarts). Valid only when lambda (T + R) << 1; meaningless at the paper's scale,
    where the cluster fails every few seconds.
    """
    lam = cfg.failure_rate_per_s
    return 1.0 - math.sqrt(2.0 * cfg.checkpoint_s * lam) - lam * cfg.restart_s


def dp_goodput_renewal(cfg: SimConfig) -> float:
    """Exact steady-state DP goodput for exponential failures and a failure-free restart.

    A segment of T work plus c checkpoint is retried until it runs failure-free; its expected cost
    is (1/lambda + R)(exp(lambda (T + c)) - 1). Ignores start-up and the run's last segment.
    """
    lam = cfg.failure_rate_per_s
    slow = straggler_slowdown(cfg.num_slices * cfg.slice_chips, cfg)
    work_s = checkpoint_every_steps(cfg) * cfg.step_s * slow
    cost = (1.0 / lam + cfg.restart_s) * math.expm1(lam * (work_s + cfg.checkpoint_s))
    return work_s / cost / slow


def capacity_up_fraction(cfg: SimConfig) -> float:
    """Long-run fraction of slices that are up: each is away `slice_return_s` per failure."""
    slice_rate = cfg.slice_chips / cfg.mtbi_chip_s
    return 1.0 / (1.0 + slice_rate * cfg.slice_return_s)


def elastic_group_goodput(cfg: SimConfig, group_slices: int, is_learner: bool) -> float:
    """Goodput of one elastic group: a failure every 1/lambda_g, each costing a fixed time.

    Each interruption costs the downscale pause, half a step in flight, the upscale pause when the
    slice returns and, for a learner, the rounds dropped while it is away.
    """
    slow = straggler_slowdown(group_slices * cfg.slice_chips, cfg)
    step_s = cfg.step_s * slow
    lam = group_slices * cfg.slice_chips / cfg.mtbi_chip_s * capacity_up_fraction(cfg)
    upscale_s = cfg.upscale_switch_s if cfg.background_upscale else cfg.upscale_s
    cost_s = cfg.downscale_s + upscale_s + step_s / 2.0
    if is_learner and not cfg.salvage_on_failure and cfg.num_learners - 1 >= cfg.quorum:
        cost_s += step_s * stale_loss_steps(cfg.downscale_s / step_s, cfg.sync_every_steps)
    return capacity_up_fraction(cfg) / (1.0 + lam * cost_s) / slow


def estimate_goodput(cfg: SimConfig, system: str) -> float:
    """Closed-form estimate of `system`'s goodput (see the functions above)."""
    if system == "dp":
        return dp_goodput_renewal(cfg)
    if system == "elastic_dp":
        return elastic_group_goodput(cfg, cfg.num_slices, is_learner=False)
    if system == "decoupled":
        return elastic_group_goodput(cfg, cfg.num_slices // cfg.num_learners, is_learner=True)
    raise ValueError(f"unknown system {system!r}")
