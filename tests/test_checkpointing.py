"""Checkpoints: exact resume, and fallback past a corrupt latest checkpoint."""

import json
import logging
import shutil

import jax
import numpy as np
import pytest

from decoupled_diloco.train import build_trainer, train_and_evaluate
from tests.conftest import tiny_config


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("mode", ["diloco", "dp"])
def test_resume_is_bit_exact(mode, corpus, tmp_path):
    # Checkpoints every 3 steps, rounds every 4: the stop falls in the middle of a round.
    config = tiny_config(
        mode=mode, train_steps=9, inner_steps=4, **{"checkpoint.every": 3, "eval.every": 0}
    )
    straight = train_and_evaluate(config, tmp_path / "straight", corpus=corpus)
    stopped = train_and_evaluate(config, tmp_path / "resumed", corpus=corpus, stop_after=6)
    assert stopped.summary["steps_done"] == 6
    resumed = train_and_evaluate(config, tmp_path / "resumed", corpus=corpus)
    assert resumed.summary["resumed_from_step"] == 6
    assert resumed.summary["outer_syncs"] == straight.summary["outer_syncs"]
    for got, want in zip(_leaves(resumed.params), _leaves(straight.params), strict=True):
        np.testing.assert_array_equal(got, want)
    # One history: the resumed run's log is the uninterrupted one (same steps, losses and
    # evals), plus the one event the stopped invocation wrote when it stopped at step 6.
    resumed_events = _events(tmp_path / "resumed")
    assert [e[0] for e in resumed_events].count(6) == 1
    assert [e for e in resumed_events if e[0] != 6] == _events(tmp_path / "straight")


def _events(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [(e["step"], e["loss"], e.get("eval_loss")) for e in map(json.loads, lines)]


def test_checkpoint_followed_by_donating_steps_restores_exactly(corpus, tmp_path):
    # The step-6 checkpoint is saved asynchronously while steps 7-9 donate the same buffers.
    config = tiny_config(train_steps=9, inner_steps=4, **{"checkpoint.every": 3})
    straight = train_and_evaluate(config, tmp_path / "straight", corpus=corpus)
    shutil.copytree(tmp_path / "straight", tmp_path / "copy")
    for learner in (tmp_path / "copy" / "checkpoints").iterdir():
        shutil.rmtree(learner / "9")
    resumed = train_and_evaluate(config, tmp_path / "copy", corpus=corpus)
    assert resumed.summary["resumed_from_step"] == 6
    for got, want in zip(_leaves(resumed.params), _leaves(straight.params), strict=True):
        np.testing.assert_array_equal(got, want)


def test_corrupt_latest_checkpoint_falls_back_to_previous(corpus, tmp_path, caplog):
    config = tiny_config(train_steps=6, inner_steps=2, **{"checkpoint.every": 3, "eval.every": 0})
    train_and_evaluate(config, tmp_path, corpus=corpus)
    learner0 = tmp_path / "checkpoints" / "learner_0"
    assert sorted(p.name for p in learner0.iterdir() if p.name.isdigit()) == ["3", "6"]
    damaged = 0
    for path in (learner0 / "6" / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage" * 7)
            damaged += 1
    assert damaged
    trainer = build_trainer(config, corpus, jax.devices(), tmp_path / "checkpoints")
    with caplog.at_level(logging.ERROR):
        assert trainer.restore() == 3
    assert "learner_0/6 is unreadable" in caplog.text
    assert trainer.syncs == 1
    # The unreadable step is discarded, so training on past it checkpoints step 6 anew.
    assert sorted(p.name for p in learner0.iterdir() if p.name.isdigit()) == ["3"]
    train_and_evaluate(config, tmp_path, corpus=corpus)
    again = build_trainer(config, corpus, jax.devices(), tmp_path / "checkpoints")
    assert again.restore() == 6
