"""Goodput simulator: DP, elastic DP and Decoupled DiLoCo under chip failures, at any scale.

Pure numpy (no JAX), so it imports and runs anywhere. Start with `simulate(SimConfig())`; the
modelling choices are documented in docs/simulator.md.
"""

from decoupled_diloco.sim.analytic import (
    dp_goodput_first_order,
    dp_goodput_renewal,
    estimate_goodput,
    young_interval_s,
)
from decoupled_diloco.sim.budgets import budget_result, budget_timelines, learner_timeline
from decoupled_diloco.sim.config import (
    SYSTEMS,
    SimConfig,
    checkpoint_every_steps,
    daly_interval_s,
    straggler_slowdown,
)
from decoupled_diloco.sim.engines import SystemResult, stale_loss_steps
from decoupled_diloco.sim.failures import FailureSchedule, explicit_schedule, poisson_schedule
from decoupled_diloco.sim.simulate import (
    goodput_from_schedule,
    run_on_schedule,
    simulate,
    sweep,
)

__all__ = [
    "SYSTEMS",
    "FailureSchedule",
    "SimConfig",
    "SystemResult",
    "budget_result",
    "budget_timelines",
    "checkpoint_every_steps",
    "daly_interval_s",
    "dp_goodput_first_order",
    "dp_goodput_renewal",
    "estimate_goodput",
    "explicit_schedule",
    "goodput_from_schedule",
    "learner_timeline",
    "poisson_schedule",
    "run_on_schedule",
    "simulate",
    "stale_loss_steps",
    "straggler_slowdown",
    "sweep",
    "young_interval_s",
]
