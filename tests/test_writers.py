"""Metric writers: TensorBoard, W&B (offline) and JSONL get the same names and values from a run.

Each writer's output is read back from disk with that format's own reader: tensorboardX's
event proto, W&B's record proto from its `.wandb` log (LevelDB log framing), plain JSON.
"""

import json
import pathlib
import struct
import time

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.obs.metrics import MetricsWriter, make_writers
from decoupled_diloco.obs.tb import read_scalars
from decoupled_diloco.train import train_and_evaluate
from tests.conftest import tiny_config

ALL = {"metrics.writers": "tensorboard,wandb,jsonl", "metrics.wandb_mode": "offline"}


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)


def read_wandb(workdir: pathlib.Path, timeout_s: float = 60.0) -> tuple[list[dict], dict]:
    """The history rows (`wandb.log` calls) and the config of the offline run in `workdir`.

    The run's file is written by W&B's own service process; on a loaded machine its history
    records can land after `finish()` has returned, so this waits (up to `timeout_s`) until the
    file stops growing and holds history.
    """
    (path,) = (workdir / "wandb").glob("offline-run-*/run-*.wandb")
    deadline, size = time.monotonic() + timeout_s, -1
    while True:
        rows, run_config = _parse_wandb(path.read_bytes())
        grown, size = path.stat().st_size != size, path.stat().st_size
        if (rows and not grown) or time.monotonic() > deadline:
            return rows, run_config
        time.sleep(0.5)


def _parse_wandb(data: bytes) -> tuple[list[dict], dict]:
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    block, pos, payload, rows, run_config = 32768, 7, b"", [], {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = wandb_internal_pb2.Record.FromString(payload)
            payload = b""
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind in ("run", "config"):  # the config comes with the run, updates after it
                update = record.run.config.update if kind == "run" else record.config.update
                run_config.update({_key(i): json.loads(i.value_json) for i in update})
    return rows, run_config


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb-core writes nested_key


def as_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{name: [(step, value)]} from W&B rows or JSONL lines, on each name's own step axis."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if name.startswith("_") or name == "step" or name.endswith("/step"):
                continue
            axis = f"{name.split('/')[0]}/step" if name.startswith("learner_") else "step"
            axis = axis if axis in row else "step"
            series.setdefault(name, []).append((row[axis], value))
    return series


def tb_series(workdir: pathlib.Path, main: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for run_dir in sorted((workdir / "tb").iterdir()):
        prefix = "" if run_dir.name == main else f"{run_dir.name}/"
        for tag, points in read_scalars(run_dir).items():
            series[prefix + tag] = points
    return series


def assert_same(a: dict, b: dict) -> None:
    """Same names, same steps, same values (TensorBoard stores float32)."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert [s for s, _ in a[name]] == [s for s, _ in b[name]], name
        assert [v for _, v in a[name]] == pytest.approx([v for _, v in b[name]], rel=1e-6), name


class ListWriter:
    """A writer of a user's own, with clu's scalar interface."""

    def __init__(self):
        self.rows, self.closed = [], False

    def write_scalars(self, step, scalars):
        self.rows.append({"step": step, **scalars})

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_a_run_writes_the_same_metrics_to_every_writer(tmp_path, corpus):
    config = tiny_config(mode="diloco", **ALL, **{"decoupled.syncer.token": "s3cret"})
    mine = ListWriter()
    train_and_evaluate(config, tmp_path, corpus=corpus, writers=[mine])
    jsonl = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    wandb_rows, wandb_config = read_wandb(tmp_path)
    assert len(wandb_rows) == len(jsonl) == len(mine.rows) == config.train_steps // 4
    series = as_series(jsonl)
    assert {"loss", "eval_loss", "tokens", "learner_loss/0", "learner_loss/1"} <= set(series)
    assert [s for s, _ in series["loss"]] == list(range(4, config.train_steps + 1, 4))
    assert_same(series, as_series(wandb_rows))
    assert_same(series, tb_series(tmp_path, "train"))
    assert_same(series, as_series(mine.rows))
    assert mine.closed
    # The W&B run carries the experiment's config, less the syncer's secret.
    assert wandb_config["optim"]["lr"] == config.optim.lr
    assert wandb_config["decoupled"]["syncer"]["token"] == "" and "s3cret" not in str(wandb_config)


def test_decoupled_learner_series_are_on_each_learners_own_step(tmp_path):
    config = tiny_config(mode="decoupled", **ALL)
    writer = MetricsWriter(tmp_path, writers=make_writers(config, tmp_path))
    for step, own in ((10, [12, 8]), (20, [22, 18])):
        writer.write(
            step=step,
            loss=3.0 / step,
            learner_losses=[2.0, None],  # learner 1 has not reported a loss: no point
            learner_steps=own,
            learner_bytes_sent=[100 * step, 50 * step],
            learner_states=["training", "joining"],  # strings: no series
            versions=[3, 2],
            eval_loss=float("nan"),  # non-finite: no point
        )
    writer.close()
    jsonl = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    series = as_series(jsonl)
    assert series["learner_0/loss"] == [(12, 2.0), (22, 2.0)]
    assert series["learner_1/bytes_sent"] == [(8, 500.0), (18, 1000.0)]
    assert "learner_1/loss" not in series and "eval_loss" not in series
    assert series["version/1"] == [(10, 2.0), (20, 2.0)]
    assert_same(series, as_series(read_wandb(tmp_path)[0]))
    assert_same(series, tb_series(tmp_path, "syncer"))
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == [
        "learner_0",
        "learner_1",
        "syncer",
    ]


def test_a_resumed_run_drops_the_jsonl_lines_it_logs_again(tmp_path):
    config = tiny_config(**{"metrics.writers": "jsonl"})
    first = MetricsWriter(tmp_path, writers=make_writers(config, tmp_path))
    for step in (10, 20, 30):
        first.write(step=step, loss=float(step))
    first.close()
    resumed = MetricsWriter(tmp_path, 20, writers=make_writers(config, tmp_path, resume_step=20))
    resumed.write(step=30, loss=99.0)
    resumed.close()
    lines = [json.loads(x) for x in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 10, "loss": 10.0},
        {"step": 20, "loss": 20.0},
        {"step": 30, "loss": 99.0},
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"metrics.writers": "tensorboard,mlflow"}, r"metrics.writers: unknown writer 'mlflow'"),
        ({"metrics.writers": "jsonl,jsonl"}, r"metrics.writers: a writer is named twice"),
        ({"metrics.wandb_mode": "sometimes"}, r"metrics.wandb_mode: must be one of"),
    ],
)
def test_bad_writer_settings_are_refused_by_name(overrides, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(tiny_config(**overrides))


def test_writers_without_a_workdir_are_refused(corpus):
    with pytest.raises(config_lib.ConfigError, match="writers: metric writers need a workdir"):
        train_and_evaluate(tiny_config(mode="dp"), None, corpus=corpus, writers=[ListWriter()])


def test_the_closing_lines_point_to_the_writers_the_run_used(tmp_path):
    from decoupled_diloco.obs.report import next_steps

    offline = tiny_config(**ALL)
    lines = next_steps(offline, tmp_path / "report.md")
    assert "tensorboard --logdir" in lines and f"wandb sync {tmp_path / 'wandb'}" in lines
    plain = next_steps(tiny_config(**{"metrics.writers": "jsonl"}), tmp_path / "report.md")
    assert "tensorboard" not in plain.lower() and "wandb" not in plain
