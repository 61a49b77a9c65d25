"""TensorBoard event files written next to metrics.jsonl, read back from disk."""

from decoupled_diloco.obs.metrics import MetricsWriter
from decoupled_diloco.obs.tb import TensorBoardWriter, read_scalars


def test_synchronous_events_go_to_one_train_run(tmp_path):
    writer = MetricsWriter(tmp_path, writers=[TensorBoardWriter(tmp_path)])
    writer.write(step=10, tokens=100, loss=3.0, learner_losses=[2.9, 3.1], wall_s=1.0)
    writer.write(step=20, tokens=200, loss=2.5, learner_losses=[2.4, 2.6], eval_loss=2.7)
    writer.close()
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["train"]
    scalars = read_scalars(tmp_path / "tb" / "train")
    assert scalars["loss"] == [(10, 3.0), (20, 2.5)]
    assert scalars["eval_loss"] == [(20, 2.700000047683716)]  # float32 in the event proto
    assert [s for s, _ in scalars["learner_loss/1"]] == [10, 20]
    assert "step" not in scalars and "wall_s" not in scalars


def test_decoupled_events_fan_out_to_one_run_per_learner(tmp_path):
    writer = MetricsWriter(tmp_path, writers=[TensorBoardWriter(tmp_path, main_run="syncer")])
    writer.write(
        step=15,
        tokens=960,
        loss=3.0,
        learner_losses=[2.0, None],  # learner 1 has not stepped yet: no point
        learner_steps=[20, 10],
        learner_states=["training", "joining"],
        versions=[3, 2],
        outer_syncs=5,
        eval_loss=float("nan"),  # non-finite: no point
    )
    writer.close()
    runs = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert runs == ["learner_0", "syncer"]
    syncer = read_scalars(tmp_path / "tb" / "syncer")
    assert syncer["version/1"] == [(15, 2.0)] and syncer["outer_syncs"] == [(15, 5.0)]
    assert "eval_loss" not in syncer
    assert read_scalars(tmp_path / "tb" / "learner_0") == {"loss": [(20, 2.0)]}


def test_resumed_run_replaces_events_after_the_resume_step(tmp_path):
    first = MetricsWriter(tmp_path, writers=[TensorBoardWriter(tmp_path)])
    for step in (10, 20, 30):
        first.write(step=step, loss=float(step))
    first.close()
    resumed = MetricsWriter(tmp_path, 20, writers=[TensorBoardWriter(tmp_path, resume_step=20)])
    resumed.write(step=30, loss=99.0)
    resumed.close()
    assert read_scalars(tmp_path / "tb" / "train")["loss"] == [(10, 10.0), (20, 20.0), (30, 99.0)]
