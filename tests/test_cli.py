"""The entry point as a user runs it: `python -m experiments.train` in a real process."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.multiprocess  # starts real processes

TINY = [
    "--config=experiments/configs/tiny_lm.py",
    "--config.model.d_model=32",
    "--config.model.mlp_hidden=64",
    "--config.model.num_layers=1",
    "--config.model.seq_len=32",
    "--config.data.batch_size=4",
    "--config.train_steps=6",
    "--config.inner_steps=3",
    "--config.eval.every=3",
    "--config.eval.batches=2",
    "--config.checkpoint.every=3",
]


def _run(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI picks the count
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_trains_and_writes_summary(tmp_path):
    proc = _run(TINY, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 6/6" in proc.stdout and "final eval loss" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("mode", "num_learners", "inner_steps", "tokens", "wall_s", "final_eval_loss"):
        assert key in summary
    assert summary["tokens"] == 6 * 2 * 4 * 32
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all({"step", "tokens", "loss", "wall_s"} <= set(e) for e in events)
    assert any("eval_loss" in e for e in events)
    assert (tmp_path / "checkpoints" / "learner_1" / "6").is_dir()


def test_cli_rejects_a_bad_config_naming_the_field(tmp_path):
    proc = _run([*TINY, "--config.inner_steps=0"], tmp_path)
    assert proc.returncode != 0
    assert "config.inner_steps: H must be >= 1" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "flag, says",
    [
        ("--config.inner_stepz=3", 'Did you mean "inner_steps"'),
        ("--config.num_learners=0", "config.num_learners: must be >= 1"),
        ("--config.data.path=no_such_folder", "no_such_folder does not exist"),
        ("--config=no_such_config.py", "--config=no_such_config.py: cannot be loaded"),
    ],
)
def test_cli_errors_are_a_line_on_stderr_and_exit_code_2(tmp_path, flag, says):
    proc = _run([*TINY, flag], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr and "--workdir" not in proc.stderr  # no flags' help
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_decoupled_run_checks_its_data_before_any_process_starts(tmp_path):
    args = ["--config.mode=decoupled", "--config.decoupled.fragments=1", "--config.data.path=nope"]
    proc = _run([*TINY, *args], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "nope does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists()  # no syncer, no learner was started
