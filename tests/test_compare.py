"""`python -m experiments.compare` on a tiny config: three modes, one table, the plots."""

import json
import os
import subprocess
import sys

import pytest

from decoupled_diloco.config import write_config_file
from decoupled_diloco.obs.tb import read_scalars
from decoupled_diloco.tasks import make_task
from tests.conftest import tiny_config
from tests.helpers import ROOT
from tests.test_writers import as_series, read_wandb

pytestmark = pytest.mark.multiprocess


def _compare(config_file, workdir, *flags):
    command = [sys.executable, "-m", "experiments.compare", f"--config={config_file}"]
    command += [f"--workdir={workdir}", *flags]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each run fakes its own
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)


def test_compare_runs_three_modes_into_one_table_and_plots(tmp_path):
    writers = {"metrics.writers": "tensorboard,wandb,jsonl", "metrics.wandb_mode": "offline"}
    config = tiny_config(**{"checkpoint.every": 0, "decoupled.fragments": 2}, **writers)
    config_file = write_config_file(config, tmp_path / "tiny.py")
    out = _compare(config_file, tmp_path / "cmp")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line[:2] == "| "}
    assert {"dp", "diloco", "decoupled"} <= set(rows)
    for mode in ("dp", "diloco", "decoupled"):
        cells = [c.strip() for c in rows[mode].split("|")[1:-1]]
        assert float(cells[1]) < 5.25  # final eval loss, well below ln(256) = 5.55 untrained
        per_step = make_task(config).tokens_per_step(config.data.batch_size)
        assert cells[3] == f"{config.train_steps * config.num_learners * per_step:,}"
        assert (tmp_path / "cmp" / mode / "report.md").exists()
    assert rows["dp"].split("|")[3].strip() == "1.000x"
    for name in ("eval_loss_tokens", "eval_loss_wall", "wall_time"):
        png = tmp_path / "cmp" / "comparison" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
        assert f"comparison/{name}.png" in table
    # TensorBoard: one run for a synchronous mode, the syncer and each learner when decoupled.
    assert "eval_loss" in read_scalars(tmp_path / "cmp" / "dp" / "tb" / "train")
    decoupled_tb = tmp_path / "cmp" / "decoupled" / "tb"
    assert {p.name for p in decoupled_tb.iterdir()} >= {"syncer", "learner_0", "learner_1"}
    assert "loss" in read_scalars(decoupled_tb / "learner_1")
    # The launcher's other writers: the same learner series, on the learner's own step.
    jsonl = (tmp_path / "cmp" / "decoupled" / "scalars.jsonl").read_text().splitlines()
    series = as_series([json.loads(line) for line in jsonl])
    assert (
        series["learner_1/loss"]
        == as_series(read_wandb(tmp_path / "cmp" / "decoupled")[0])["learner_1/loss"]
    )
    assert [s for s, _ in series["learner_1/loss"]] == [
        s for s, _ in read_scalars(decoupled_tb / "learner_1")["loss"]
    ]
    # A finished run of the same config is kept, not trained again.
    again = _compare(config_file, tmp_path / "cmp", "--modes=dp")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "same config already finished" in again.stdout and "[dp] step" not in again.stdout
