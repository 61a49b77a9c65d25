"""The per-learner step-budget model of the calibration (decoupled_diloco/sim/budgets.py), against
numbers worked out by hand."""

import pytest

from decoupled_diloco.obs import timeline as timeline_lib
from decoupled_diloco.sim import goodput_from_schedule, learner_timeline

# One learner, 10 steps of 1 s; step 1 compiles inside the 2 s start-up, so step 2 starts at 2;
# a checkpoint after steps 4, 8 and 10 (the last) takes 0.5 s. Failure-free: steps 2-4 run
# 2..5, checkpoint 4 5..5.5, steps 5-8 5.5..9.5, checkpoint 8 ..10, steps 9-10 ..12, checkpoint
# 10 ..12.5, done at 12.5.
KW = dict(steps=10, step_s=1.0, startup_s=2.0, restart_s=3.0, rejoin_s=2.0, checkpoint_every=4)


def _restored_to(records: list[timeline_lib.Record]) -> list[int]:
    """The step each restart resumed from (its compiling step - 1)."""
    return [r.step - 1 for r in records if r.state == "compiling"][1:]


def test_failure_free_learner_matches_the_hand_timeline() -> None:
    recs = learner_timeline([], checkpoint_s=0.5, **KW)
    assert recs[-1] == timeline_lib.Record(12.5, "done")
    ckpts = [(r.t, r.step) for r in recs if r.state == "checkpointing"]
    assert ckpts == [(5.0, 4), (9.5, 8), (12.0, 10)]


def test_a_kill_loses_exactly_the_steps_since_the_last_checkpoint() -> None:
    # Killed at 8.0, in step 7 (7.5..8.5): checkpoint 4 is committed (5 + 0.5 <= 8), so the
    # learner re-executes steps 5, 6 and 7: 3 lost steps (C/2 would say 2). Down 8..11, rejoin
    # 11..13 compiling step 5, steps 6-8 13..16, checkpoint 8 ..16.5, steps 9-10 ..18.5,
    # checkpoint 10 ..19: done at 19.
    recs = learner_timeline([8.0], checkpoint_s=0.5, **KW)
    assert _restored_to(recs) == [4]
    stats = timeline_lib.analyze({0: recs})
    assert stats.lost_steps == 3
    assert recs[-1] == timeline_lib.Record(19.0, "done")
    # Allocated 19 - 3 down = 16 s; productive: the last runs of steps 2-4 and 6-10 (step 5's
    # last run compiled): 8 s.
    assert stats.goodput == pytest.approx(8.0 / 16.0)
    res = goodput_from_schedule(
        "decoupled",
        [(8.0, 0)],
        num_learners=1,
        total_steps=10,
        step_s=1.0,
        restart_s=3.0,
        rejoin_s=2.0,
        startup_s=2.0,
        checkpoint_every_steps=4,
        checkpoint_s=0.5,
        step_budgets=True,
    )
    assert res.wall_s == pytest.approx(19.0) and res.goodput == pytest.approx(0.5)


def test_a_kill_before_the_asynchronous_save_commits_rolls_back_further() -> None:
    # Killed at 6.0, in step 5 (5.5..6.5). Checkpoint 4 started at 5.0: committed at 5.5 with
    # a 0.5 s commit, so 1 step is lost; with a 2 s commit it is not on disk yet, the learner
    # starts over from step 0 and steps 1-5 are lost.
    quick = learner_timeline([6.0], checkpoint_s=0.5, commit_s=0.5, **KW)
    slow = learner_timeline([6.0], checkpoint_s=0.5, commit_s=2.0, **KW)
    assert _restored_to(quick) == [4] and _restored_to(slow) == [0]
    assert timeline_lib.analyze({0: quick}).lost_steps == 1
    assert timeline_lib.analyze({0: slow}).lost_steps == 5


def test_a_late_kill_extends_the_run_and_kills_while_down_or_done_are_refused() -> None:
    # Two learners, no checkpoints, 10 steps each: failure-free both are done at 2 + 9 = 11.
    kw = dict(
        num_learners=2,
        total_steps=10,
        step_s=1.0,
        restart_s=3.0,
        rejoin_s=2.0,
        startup_s=2.0,
        step_budgets=True,
    )
    free = goodput_from_schedule("decoupled", [], **kw)
    assert free.wall_s == pytest.approx(11.0)
    # Learner 1 killed at 10.5, in its last step: no checkpoint, so it starts over: down until
    # 13.5, rejoined at 15.5 (step 1 compiled), steps 2-10 until 24.5, the run's end. The kill
    # at 12.0 (learner 1 down) and at 11.5 (learner 0 done) are refused.
    kills = [(10.5, 1), (11.5, 0), (12.0, 1)]
    res = goodput_from_schedule("decoupled", kills, **kw)
    assert res.wall_s == pytest.approx(24.5) and res.interruptions == 1
    # Allocated: 11 (learner 0) + 24.5 - 3 down; productive: 9 steps of each learner.
    assert res.goodput == pytest.approx(18.0 / (11.0 + 21.5))


def test_step_budgets_is_for_decoupled_only() -> None:
    with pytest.raises(ValueError, match="decoupled runs only"):
        goodput_from_schedule(
            "dp",
            [],
            num_learners=1,
            total_steps=5,
            step_s=1.0,
            restart_s=1.0,
            rejoin_s=1.0,
            step_budgets=True,
        )
