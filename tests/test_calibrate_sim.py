"""Calibration of the goodput simulator against a chaos run (`decoupled_diloco.sim calibrate`),
on a hand-made run directory in the real on-disk format (timelines, metrics.jsonl, summary.json)."""

import json
import os
import pathlib

import pytest

from decoupled_diloco.obs import timeline as timeline_lib
from decoupled_diloco.sim import calibration as calibrate_sim
from decoupled_diloco.sim import goodput_from_schedule

T0 = 1_000_000.0


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _steps(learner: int, first: int, last: int, t: float) -> list[dict]:
    """One-second `stepping` records for steps first..last starting at t (seconds after T0)."""
    return [
        {"t": T0 + t + i, "state": "stepping", "learners": [learner], "step": s}
        for i, s in enumerate(range(first, last + 1))
    ]


def _rec(learner: int, t: float, state: str, step: int = -1) -> dict:
    out = {"t": T0 + t, "state": state, "learners": [learner]}
    if step >= 0:
        out["step"] = step
    return out


@pytest.fixture
def run_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Two decoupled learners, 20 steps each, checkpoint every 10; learner 1 killed at 10.9 s."""
    tl = tmp_path / "timeline"
    tl.mkdir()
    learner0 = [
        _rec(0, 2, "restoring"),
        _rec(0, 3, "compiling", 1),
        *_steps(0, 2, 11, 5),  # 5..15
        _rec(0, 15, "checkpointing", 11),
        *_steps(0, 12, 20, 15.5),  # 15.5..24.5
        _rec(0, 24.5, "done"),
    ]
    learner1 = [
        _rec(1, 2, "restoring"),
        _rec(1, 3, "compiling", 1),
        *_steps(1, 2, 7, 5),  # step 7 starts at 10 and is cut by the kill
        # restarted: no checkpoint yet, so it starts over from step 1
        _rec(1, 33, "restoring"),
        _rec(1, 35, "compiling", 1),
        *_steps(1, 2, 20, 38),  # 38..57
        _rec(1, 57, "done"),
    ]
    supervisor = [
        _rec(0, 0, "starting"),
        _rec(1, 0, "starting"),
        _rec(1, 10.8, "down"),
        _rec(1, 30.8, "starting"),
    ]
    _write_jsonl(tl / "learner_0.jsonl", learner0)
    _write_jsonl(tl / "learner_1.jsonl", learner1)
    _write_jsonl(tl / "supervisor.jsonl", supervisor)
    events = [
        {"step": 5, "loss": 3.0},
        {"time": T0 + 10.9, "wall_s": 10.9, "event": "fault", "kind": "kill", "learner": 1},
        {"time": T0 + 30.8, "wall_s": 30.8, "event": "recovery", "kind": "restart"},
    ]
    _write_jsonl(tmp_path / "metrics.jsonl", events)
    config = {
        "mode": "decoupled",
        "num_learners": 2,
        "train_steps": 20,
        "inner_steps": 8,
        "checkpoint": {"every": 10},
    }
    (tmp_path / "summary.json").write_text(json.dumps({"config": config, "goodput": 0.5}))
    # The checkpoint learner 0 started at 15 s, committed (Orbax's marker) at 15.7 s.
    marker = tmp_path / "checkpoints" / "learner_0" / "11" / "commit_success.txt"
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    os.utime(marker, (T0 + 15.7, T0 + 15.7))
    return tmp_path


def test_extract_reads_schedule_and_times(run_dir: pathlib.Path) -> None:
    facts = calibrate_sim.extract(run_dir)
    assert facts.mode == "decoupled" and facts.num_learners == 2 and facts.train_steps == 20
    assert facts.checkpoint_every == 10 and facts.sync_every_steps == 8
    # Timed by the supervisor's `down` record (10.8), not the fault event logged after it.
    assert facts.kills == [(pytest.approx(10.8), 1)]
    assert facts.restart_s == pytest.approx(30.8 - 10.8)  # kill -> process started again
    assert facts.rejoin_s == pytest.approx(38.0 - 30.8)  # started -> first counted step
    assert facts.startup_s == pytest.approx(5.0)  # both learners: first record -> first step
    # The step cut by the kill (0.8 s) is left out; every other step took 1 s.
    assert facts.step_s == pytest.approx(1.0)
    assert facts.checkpoint_s == pytest.approx(0.5)
    assert facts.commit_s == pytest.approx(0.7)
    assert facts.steps_done == 20 and not facts.capped
    assert facts.window_s == pytest.approx(57.0)
    assert facts.first_done_s == pytest.approx(24.5)
    measured = timeline_lib.analyze(timeline_lib.load(run_dir / "timeline"))
    assert facts.goodput == pytest.approx(measured.goodput)
    # By hand: productive = 19 + 19 steps of 1 s; allocated = 24.5 + (57 - 20 down).
    assert facts.goodput == pytest.approx(38.0 / (24.5 + 37.0))


def test_predict_decoupled_runs_learners_with_their_own_budgets(run_dir: pathlib.Path) -> None:
    facts = calibrate_sim.extract(run_dir)
    pred = calibrate_sim.predict(facts)
    # By hand (step 1 s, start-up 5 s, checkpoint every 10 steps taking 0.5 s): learner 0 runs
    # steps 2-10 5..14, checkpoint ..14.5, steps 11-20 ..24.5, last checkpoint ..25: done at 25.
    # Learner 1 is killed at 10.8, before any checkpoint: down until 30.8, first step 2 at
    # 30.8 + 7.2 = 38, then as learner 0 from 5: done at 58. Productive 19 s each (step 1
    # compiles); allocated 25 + (58 - 20 down).
    assert pred.system == "budgets"
    assert pred.wall_s == pytest.approx(58.0)
    assert pred.goodput == pytest.approx(38.0 / (25.0 + 38.0))
    # Steps 1-6 ran and 7 was cut by the kill; all 7 run again: 7 lost steps.
    assert pred.lost_steps == 7 and pred.kills_hit == 1
    res = goodput_from_schedule(
        "decoupled",
        facts.kills,
        num_learners=2,
        total_steps=20,
        step_s=1.0,
        restart_s=20.0,
        rejoin_s=7.2,
        startup_s=5.0,
        checkpoint_every_steps=10,
        checkpoint_s=0.5,
        checkpoint_commit_s=0.7,
        step_budgets=True,
    )
    assert res.goodput == pytest.approx(pred.goodput)
    line = calibrate_sim.row("synthetic", facts)
    assert line.count("|") == calibrate_sim.HEADER.count("|")


def test_predict_pooled_bills_like_the_run(run_dir: pathlib.Path) -> None:
    facts = calibrate_sim.extract(run_dir)
    pred = calibrate_sim.predict(facts, pooled=True)
    res = goodput_from_schedule(
        "decoupled",
        facts.kills,
        num_learners=2,
        total_steps=20,
        step_s=1.0,
        restart_s=facts.restart_s,
        rejoin_s=facts.rejoin_s,
        startup_s=5.0,
        checkpoint_every_steps=10,
        checkpoint_s=0.5,
        sync_every_steps=10,  # H := the checkpoint cadence
    )
    assert pred.sim_goodput == pytest.approx(res.goodput)
    # Same run, the run's definition: the down time (restart_s of learner 1) is not billed.
    assert pred.goodput == pytest.approx(2 * 20 / (2 * res.wall_s - facts.restart_s))


def test_extract_rejects_a_directory_that_is_not_a_run(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="not a chaos run"):
        calibrate_sim.extract(tmp_path)


def test_dp_without_spares_restarts_over_on_a_failure_during_the_restart() -> None:
    kw = dict(
        num_learners=2,
        total_steps=20,
        step_s=1.0,
        restart_s=4.0,
        rejoin_s=2.0,
        checkpoint_every_steps=5,
    )
    failures = [(10.0, 0), (15.0, 1)]
    # By hand: 10 steps committed at t=10; the restart would end at 16, but the failure at 15
    # lands inside it: with spares it is absorbed (16 + 10 steps = 26), without it the restart
    # starts over and ends at 21 (21 + 10 = 31).
    spares = goodput_from_schedule("dp", failures, **kw)
    none = goodput_from_schedule("dp", failures, spares=False, **kw)
    assert spares.wall_s == pytest.approx(26.0)
    assert none.wall_s == pytest.approx(31.0)
    assert none.goodput == pytest.approx(20.0 / 31.0)
