"""The MoE LM and the ViT in decoupled mode: a syncer and two learner processes, real gRPC.

Each run goes through `python -m experiments.train` with the model's own config file, shrunk to
a few steps; it waits for the process with a generous deadline and reaps every child it started,
even on failure.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_budget_trained_once

COMMON = [
    "--config.num_learners=2",
    "--config.inner_steps=8",
    "--config.decoupled.fragments=2",
    "--config.eval.every=0",
    "--config.log_every=8",
]
MODELS = {
    "moe": [
        "--config=experiments/configs/tiny_moe.py:decoupled",
        "--config.model.d_model=32",
        "--config.model.mlp_hidden=32",
        "--config.model.num_layers=1",
        "--config.model.seq_len=32",
        "--config.data.batch_size=8",
        "--config.eval.batches=2",
        # Router and expert tensors go through compression like any other tensor.
        "--config.compression.scheme=int8",
        "--config.train_steps=16",
    ],
    "vit": [
        "--config=experiments/configs/tiny_vit.py:decoupled",
        "--config.model.d_model=32",
        "--config.model.mlp_hidden=64",
        "--config.model.num_layers=1",
        "--config.data.batch_size=16",
        "--config.eval.batches=16",
        "--config.train_steps=96",
    ],
}
STEPS = {"moe": 16, "vit": 96}
# What the run must reach: well below the untrained model's loss (ln 256 = 5.55 for the byte
# LM, ln 10 = 2.30 for the ten digits) and, for the ViT, well above the 10% of guessing. Seen:
# MoE 4.41 after 16 steps; ViT 1.38-1.41 and 67-69% after 96 (256 validation images; after 48
# steps on 64 images it was 19-41%, too close to the bar under CI's load).
MAX_LOSS = {"moe": 5.0, "vit": 1.9}

pytestmark = pytest.mark.multiprocess


def _children_of(workdir):
    """PIDs of live processes whose command line names `workdir` (the learners and syncer)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(workdir) in cmdline and "experiments.train" not in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("model", sorted(MODELS))
def test_one_decoupled_run_with_two_learners_completes(model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DD_RUN_TOKEN"] = "models-test-token"
    cmd = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}"]
    proc = subprocess.Popen(
        [*cmd, *MODELS[model], *COMMON],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["mode"] == "decoupled" and summary["config"]["model"]["kind"] == model
        assert_budget_trained_once(summary, learners=2)
        # Every fragment was merged at least twice (two rounds of H=8 per learner).
        assert all(f["version"] >= 2 for f in summary["fragments"])
        assert summary["final_eval_loss"] < MAX_LOSS[model], summary["final_eval_loss"]
        assert summary["config"]["compression"]["scheme"] == ("int8" if model == "moe" else "none")
        if model == "vit":
            assert 0.4 <= summary["final_eval_accuracy"] <= 1.0, summary["final_eval_accuracy"]
        else:
            assert "final_eval_accuracy" not in summary
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _children_of(tmp_path):
            os.kill(pid, signal.SIGKILL)
