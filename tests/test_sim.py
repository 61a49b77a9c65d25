"""Tests of the goodput simulator against hand-computed cases and checkpointing theory."""

import dataclasses
import math

import numpy as np
import pytest

from decoupled_diloco.sim import (
    SimConfig,
    checkpoint_every_steps,
    daly_interval_s,
    dp_goodput_first_order,
    dp_goodput_renewal,
    explicit_schedule,
    goodput_from_schedule,
    poisson_schedule,
    run_on_schedule,
    simulate,
    stale_loss_steps,
    straggler_slowdown,
    young_interval_s,
)

# A small cluster where every number is easy to follow: 8 one-chip slices, 4 learners of 2 slices,
# 1000 one-second steps, so an ideal-second of work is one step of the whole cluster.
SMALL = SimConfig(
    num_chips=8,
    slice_chips=1,
    slice_return_s=200.0,
    total_tokens=1000.0,
    tokens_per_step=1.0,
    step_s=1.0,
    startup_s=0.0,
    checkpoint_s=5.0,
    checkpoint_every_steps=100,
    restart_s=30.0,
    downscale_s=4.0,
    upscale_s=14.0,
    num_learners=4,
    sync_every_steps=24,
)
NO_FAILURES = explicit_schedule([])
ONE_FAILURE = explicit_schedule([(250.4, 3)])  # slice 3 belongs to learner 1


def test_no_failures_goodput_is_one_minus_fixed_overheads():
    cfg = dataclasses.replace(SMALL, startup_s=100.0, checkpoint_every_steps=50, checkpoint_s=2.0)
    # DP: start-up, then 1000 steps with a checkpoint after every 50 except after the last one.
    dp_wall = 100.0 + 1000.0 + (1000 // 50 - 1) * 2.0
    dp = run_on_schedule(cfg, "dp", NO_FAILURES)
    assert dp.wall_s == pytest.approx(dp_wall)
    assert dp.goodput == pytest.approx(1000.0 / dp_wall)
    assert dp.uptime == pytest.approx(1000.0 / dp_wall)
    # Elastic DP and decoupled have no checkpoint stalls: only the start-up.
    for system in ("elastic_dp", "decoupled"):
        res = run_on_schedule(cfg, system, NO_FAILURES)
        assert res.goodput == pytest.approx(1000.0 / 1100.0), system
        assert res.uptime == pytest.approx(1000.0 / 1100.0), system
        assert res.interruptions == 0


def test_no_failures_straggler_overhead():
    cfg = dataclasses.replace(SMALL, chip_speed_cv=0.05)
    whole = straggler_slowdown(8, cfg)  # DP and elastic wait for the slowest of 8 chips
    per_learner = straggler_slowdown(2, cfg)  # a learner waits only for its own 2 chips
    assert whole > per_learner > 1.0
    assert run_on_schedule(cfg, "elastic_dp", NO_FAILURES).goodput == pytest.approx(1 / whole)
    assert run_on_schedule(cfg, "decoupled", NO_FAILURES).goodput == pytest.approx(1 / per_learner)


def test_single_failure_dp_loses_work_since_checkpoint_plus_restart():
    res = run_on_schedule(SMALL, "dp", ONE_FAILURE)
    # Checkpoints complete at 105 s and 210 s (100 steps + 5 s each). The failure at 250.4 s
    # throws away the 40.4 s since then; the restart takes 30 s; 800 steps and 7 checkpoints remain.
    assert res.wall_s == pytest.approx(250.4 + 30.0 + 800.0 + 7 * 5.0)
    assert res.lost["rolled_back"] * res.wall_s == pytest.approx(40.4)
    assert res.interruptions == 1


def test_single_failure_elastic_dp_pauses_everyone_and_runs_smaller():
    res = run_on_schedule(SMALL, "elastic_dp", ONE_FAILURE)
    # Deficit in cluster-seconds: 0.4 s of the step in flight, a 4 s downscale pause, 196 s at
    # 7/8 capacity until the slice returns at 450.4 s, then a 14 s upscale pause.
    deficit = 0.4 + 4.0 + 196.0 / 8.0 + 14.0
    assert res.wall_s == pytest.approx(1000.0 + deficit)
    assert res.uptime == pytest.approx((res.wall_s - 18.0) / res.wall_s)


def test_single_failure_decoupled_costs_only_its_learner():
    res = run_on_schedule(SMALL, "decoupled", ONE_FAILURE)
    rate = 2.0 / 8.0  # learner 1 holds 2 of the 8 slices
    in_flight = rate * 0.4
    # Away 4 steps: fragments due in that window close without it; loss = D - D^2 / (2H).
    stale = rate * (4.0 - 16.0 / 48.0)
    deficit = in_flight + stale + 4.0 * rate + 196.0 / 8.0 + 14.0 * rate
    assert res.wall_s == pytest.approx(1000.0 + deficit)
    assert res.lost["stale_rounds"] * res.wall_s == pytest.approx(stale)
    assert res.uptime == pytest.approx(1.0)  # three learners keep going: quorum 1 always met


def test_single_failure_go_beyond_policies_remove_exactly_their_cost():
    base = run_on_schedule(SMALL, "decoupled", ONE_FAILURE).wall_s
    salvage = dataclasses.replace(SMALL, salvage_on_failure=True)
    background = dataclasses.replace(SMALL, background_upscale=True, upscale_switch_s=1.0)
    stale = 0.25 * (4.0 - 16.0 / 48.0)
    assert run_on_schedule(salvage, "decoupled", ONE_FAILURE).wall_s == pytest.approx(base - stale)
    saved = 0.25 * (14.0 - 1.0)
    assert run_on_schedule(background, "decoupled", ONE_FAILURE).wall_s == pytest.approx(
        base - saved
    )


def test_failure_on_a_slice_already_down_is_a_no_op():
    twice = explicit_schedule([(250.4, 3), (300.0, 3)])
    for system in ("elastic_dp", "decoupled"):
        once = run_on_schedule(SMALL, system, ONE_FAILURE)
        res = run_on_schedule(SMALL, system, twice)
        assert res.wall_s == pytest.approx(once.wall_s), system
        assert res.interruptions == 1


def test_failure_during_pause_is_absorbed():
    # Second failure 2 s into the 4 s downscale pause: no extra pause, no extra step lost. Both
    # slices are away while the job runs at 6/8 from 254.4 s; the second returns at 452.4 s, during
    # the first one's 14 s upscale pause, and joins when it ends.
    res = run_on_schedule(SMALL, "elastic_dp", explicit_schedule([(250.4, 3), (252.4, 5)]))
    deficit = 0.4 + 4.0 + (450.4 - 254.4) * 2.0 / 8.0 + 14.0
    assert res.wall_s == pytest.approx(1000.0 + deficit)


def test_decoupled_with_one_learner_equals_elastic_dp():
    cfg = SimConfig(num_chips=1_200_000, num_learners=1, total_tokens=2e10)
    schedule = poisson_schedule(cfg, 2e4)
    one = run_on_schedule(cfg, "decoupled", schedule)
    elastic = run_on_schedule(cfg, "elastic_dp", schedule)
    assert one.interruptions > 100
    assert one.wall_s == pytest.approx(elastic.wall_s)


def test_stale_loss_is_bounded_by_half_a_sync_period():
    assert stale_loss_steps(0.0, 24) == 0.0
    assert stale_loss_steps(4.0, 24) == pytest.approx(4.0 - 16.0 / 48.0)
    assert stale_loss_steps(24.0, 24) == pytest.approx(12.0)
    assert stale_loss_steps(1e6, 24) == pytest.approx(12.0)


@pytest.mark.parametrize("chips", [10_000, 40_000])
def test_dp_optimal_checkpointing_matches_young_daly_first_order(chips):
    # Valid regime: lambda (T* + R) << 1 (about 0.03 and 0.09 here).
    cfg = SimConfig(num_chips=chips, total_tokens=2e11)
    lam = cfg.failure_rate_per_s
    assert lam * (young_interval_s(cfg.checkpoint_s, 1 / lam) + cfg.restart_s) < 0.1
    res = simulate(cfg, ("dp",))["dp"]
    assert res.interruptions > 5
    assert res.goodput == pytest.approx(dp_goodput_first_order(cfg), abs=0.02)


def test_dp_matches_exact_renewal_theory_far_outside_first_order_regime():
    cfg = SimConfig(num_chips=1_200_000, total_tokens=1e11)
    res = simulate(cfg, ("dp",))["dp"]
    assert res.interruptions > 1000
    assert res.goodput == pytest.approx(dp_goodput_renewal(cfg), abs=0.01)
    # First order is useless here: it predicts negative goodput.
    assert dp_goodput_first_order(cfg) < 0


def test_daly_interval_reduces_to_young_and_sets_steps():
    assert daly_interval_s(1.0, 1e6) == pytest.approx(young_interval_s(1.0, 1e6), rel=1e-3)
    cfg = SimConfig(num_chips=1_200_000)
    expected = daly_interval_s(cfg.checkpoint_s, 1 / cfg.failure_rate_per_s) / cfg.step_s
    assert checkpoint_every_steps(cfg) == round(expected)
    assert checkpoint_every_steps(dataclasses.replace(cfg, checkpoint_every_steps=7)) == 7


def test_poisson_schedule_rate_and_prefix_consistency():
    cfg = SimConfig(num_chips=2_400_000)
    short, long = poisson_schedule(cfg, 1e4), poisson_schedule(cfg, 3e4)
    expected = cfg.failure_rate_per_s * 1e4
    assert abs(short.times_s.size - expected) < 5 * math.sqrt(expected)
    n = short.times_s.size
    np.testing.assert_array_equal(long.times_s[:n], short.times_s)
    np.testing.assert_array_equal(long.slice_ids[:n], short.slice_ids)
    assert short.slice_ids.min() >= 0 and short.slice_ids.max() < cfg.num_slices


def test_paper_ordering_and_zero_global_downtime_at_scale():
    cfg = SimConfig(num_chips=2_400_000, num_learners=4, total_tokens=5e10)
    res = simulate(cfg)
    assert res["dp"].goodput < res["elastic_dp"].goodput < res["decoupled"].goodput
    assert res["decoupled"].uptime > 0.99
    assert res["dp"].uptime < 0.5


def test_goodput_from_schedule_hand_computed_chaos_run():
    kw = dict(
        failures=[(20.05, 0)],
        num_learners=2,
        total_steps=1000,
        step_s=0.1,
        restart_s=5.0,
        rejoin_s=2.0,
        checkpoint_every_steps=100,
        sync_every_steps=10,
    )
    # Decoupled: learner 0 (half the work) loses its half-done step, is away 7 s (70 steps, so a
    # full sync period of fragments closes without it: H/2 = 5 steps lost), learner 1 never stops.
    dec = goodput_from_schedule("decoupled", **kw)
    deficit = 0.5 * 0.05 + 0.5 * 5 * 0.1 + 0.5 * 7.0
    assert dec.wall_s == pytest.approx(100.0 + deficit)
    assert dec.uptime == pytest.approx(1.0)
    # DP: back to the checkpoint at 20 s (200 steps), stopped 7 s, then 800 steps.
    dp = goodput_from_schedule("dp", **kw)
    assert dp.wall_s == pytest.approx(20.05 + 7.0 + 80.0)
    assert dp.goodput == pytest.approx(100.0 / 107.05)
    with pytest.raises(ValueError):
        goodput_from_schedule("decoupled", **{**kw, "failures": [(1.0, 2)]})
