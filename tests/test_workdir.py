"""One run per workdir: another config is refused there; a resumed run's curves do not repeat."""

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.obs.tb import read_scalars
from decoupled_diloco.train import train_and_evaluate
from tests.conftest import tiny_config


def test_a_workdir_takes_no_run_of_another_config(tmp_path, corpus):
    config = tiny_config(mode="dp", **{"checkpoint.every": 4})
    train_and_evaluate(config, tmp_path, corpus=corpus)
    other = config_lib.replace(config, **{"model.d_model": 64, "optim.lr": 1e-3})
    with pytest.raises(config_lib.ConfigError, match=r"model.d_model: 32 -> 64.*optim.lr"):
        train_and_evaluate(other, tmp_path, corpus=corpus)
    # The same run, longer and logged differently: resumed from its checkpoint at step 8.
    longer = config_lib.replace(config, train_steps=12, log_every=2)
    result = train_and_evaluate(longer, tmp_path, corpus=corpus)
    assert result.summary["steps_done"] == 12
    loss = read_scalars(tmp_path / "tb" / "train")["loss"]
    steps = [s for s, _ in loss]
    assert steps == sorted(set(steps)) and steps[-1] == 12  # no step twice, in order


def test_a_fresh_rerun_replaces_the_earlier_curves(tmp_path, corpus):
    config = tiny_config(mode="dp")  # no checkpoints: every run starts at step 0
    for _ in range(2):
        train_and_evaluate(config, tmp_path, corpus=corpus)
    assert len(list((tmp_path / "tb" / "train").glob("events.out.tfevents.*"))) == 1
    steps = [s for s, _ in read_scalars(tmp_path / "tb" / "train")["loss"]]
    assert steps == sorted(set(steps))
