"""Decoupled mode end to end: real processes, real gRPC on 127.0.0.1, a tiny model.

Each test starts a syncer and two learner processes through `python -m experiments.train`,
waits on step counts and states (generous deadlines, no fixed sleeps), and reaps everything
it started even when it fails.
"""

import email
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

import decoupled_diloco as dd
from decoupled_diloco import config as config_lib
from decoupled_diloco.comm.client import SyncerClient
from tests.helpers import ROOT, assert_budget_trained_once, popen_logged, tail, wait_until

TOKEN = "multiprocess-test-token"
TINY = [
    f"--config={ROOT / 'experiments/configs/tiny_lm.py'}",
    "--config.mode=decoupled",
    "--config.model.d_model=32",
    "--config.model.mlp_hidden=64",
    "--config.model.num_layers=1",
    "--config.model.seq_len=32",
    "--config.data.batch_size=8",
    "--config.inner_steps=8",
    "--config.eval.every=0",
    "--config.eval.batches=2",
    "--config.checkpoint.every=0",
    "--config.log_every=20",
    "--config.outer.merge=rda",
]

pytestmark = pytest.mark.multiprocess


def _children_of(workdir):
    """PIDs of live processes whose command line names `workdir` (the learners and syncer)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = next(
                line for line in (proc / "status").read_text().splitlines() if line[:6] == "State:"
            )
        except (OSError, StopIteration):
            continue
        if str(workdir) in cmdline and "experiments.train" not in cmdline and "Z" not in state:
            pids.append(int(proc.name))
    return pids


# Execs the command in argv[1:] with SIGINT ignored, as `cmd &` in a script (or a CI runner)
# starts it: Python keeps an inherited SIG_IGN.
_SIGINT_IGNORED = (
    "import os, signal, sys; signal.signal(2, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"  # noqa: E501
)


def _launch(workdir, *args, sigint_ignored=False, cwd=ROOT):
    """The launcher, its output in `workdir/launcher.log` (`_output`)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DD_RUN_TOKEN"] = TOKEN
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *TINY, *args]
    if sigint_ignored:
        command = [sys.executable, "-c", _SIGINT_IGNORED, *command]
    return popen_logged(command, workdir / "launcher.log", cwd=cwd, env=env)


def _output(workdir, chars=3000):
    """The last `chars` characters the launcher printed (None: all)."""
    return tail(workdir / "launcher.log", chars)


def _cleanup(proc, workdir):
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in _children_of(workdir):
        os.kill(pid, signal.SIGKILL)


def test_two_learners_with_different_meshes_train_to_the_end(tmp_path):
    # Started from the user's own directory with a relative data.path: the children (run from
    # the package's root) read the same folder.
    user = tmp_path / "user"
    shutil.copytree(pathlib.Path(json.__file__).parent, user / "mytext" / "json")
    shutil.copytree(pathlib.Path(email.__file__).parent, user / "mytext" / "email")
    proc = _launch(
        tmp_path,
        "--config.train_steps=64",
        "--config.decoupled.mesh_shapes=1x1,2x1",
        "--config.eval.every=32",
        "--config.data.path=mytext",
        cwd=user,
    )
    try:
        proc.wait(timeout=240)
        assert proc.returncode == 0, _output(tmp_path)
        summary = json.loads((tmp_path / "summary.json").read_text())
        for key in ("mode", "num_learners", "inner_steps", "tokens", "wall_s", "final_eval_loss"):
            assert key in summary
        assert summary["mode"] == "decoupled" and summary["num_learners"] == 2
        assert summary["corpus"]["root"] == str(user / "mytext"), summary["corpus"]
        # Tokens trained: the budget, and again whatever a lease handed again was retrained
        # (data leases: the ledger below shows the data in the global model exactly once).
        assert summary["tokens"] == 8 * 32 * sum(x["steps"] for x in summary["learners"])
        assert summary["tokens"] >= 2 * 64 * 8 * 32 and summary["steps_done"] == 64
        assert summary["final_eval_loss"] < 4.5  # ln(256) = 5.55 at init
        # Bits per byte of the global model: on a byte corpus, nats per byte / ln 2.
        assert summary["final_eval_bpb"] == pytest.approx(summary["final_eval_loss"] / math.log(2))
        evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open() if "eval_bpb" in x]
        assert evals and all(e["eval_bpb"] > 0 for e in evals)
        # The syncer's global model, kept as the run's model: loaded and sampled from outside.
        trained = dd.load_model(tmp_path)
        assert trained.info["mode"] == "decoupled"
        assert trained.info["final_eval_loss"] == summary["final_eval_loss"]
        assert isinstance(dd.generate(trained, "def ", max_new_tokens=4, temperature=0.0), str)
        assert [x["mesh"] for x in summary["learners"]] == ["1x1", "2x1"]
        assert_budget_trained_once(summary, learners=2)
        # Both learners' pushes were merged, and each applied merged fragments it did not
        # produce alone (versions moved past its own pushes).
        assert summary["outer_syncs"] >= 2 * 8
        assert all(min(x["versions"]) >= 1 for x in summary["learners"])
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert lines and lines[-1]["learner_states"] == ["done", "done"]
        evals = [x["eval_loss"] for x in lines if "eval_loss" in x]  # of the global parameters
        assert evals and all(e < 5.3 for e in evals)  # ln(256) = 5.55 at init
        out = _output(tmp_path, None)
        assert "[decoupled]" in out and "final eval loss" in out
        assert _children_of(tmp_path) == []
    finally:
        _cleanup(proc, tmp_path)


def test_slow_learner_does_not_slow_the_other_and_ctrl_c_leaves_nothing(tmp_path):
    steps = 400
    proc = _launch(
        tmp_path,
        f"--config.train_steps={steps}",
        "--config.decoupled.quorum=1",
        "--config.slow_learner=1",
        "--config.slowdown=5",
        # Static shards: the fast learner's own share ends while the slow one trains on (on
        # data leases the fast one takes most of the budget; tests/test_elastic.py).
        "--config.decoupled.data_shards=0",
        # Ctrl+C must stop it even so (it did not: the launcher then trained on to its end).
        sigint_ignored=True,
    )
    try:
        port_file = tmp_path / "syncer.port"
        wait_until(port_file.exists, 120, "the syncer's port file")
        client = SyncerClient(
            f"127.0.0.1:{port_file.read_text()}", config_lib.SyncerConfig(), TOKEN
        )

        def fast_done():
            learners = client.status()["learners"]
            return learners if learners.get("0", {}).get("state") == "done" else None

        learners = wait_until(fast_done, 180, "the fast learner to finish")
        client.close()
        # Quorum 1: the fast learner never waited for the 5x slower one.
        assert learners["0"]["step"] == steps
        assert learners["1"]["step"] <= steps // 2, learners["1"]
        assert proc.poll() is None and _children_of(tmp_path)  # the slow learner trains on
        proc.send_signal(signal.SIGINT)  # Ctrl+C
        try:
            proc.wait(timeout=60)  # (the launcher cuts a clean-up that hangs after 45 s)
        except subprocess.TimeoutExpired as error:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack, into the log
            stacks = lambda: "Thread 0x" in _output(tmp_path, None)  # noqa: E731
            wait_until(stacks, 30, "the launcher's stacks")
            log = _output(tmp_path, 20000)
            raise AssertionError(f"Ctrl+C did not end the launcher:\n{log}") from error
        # Ended by the KeyboardInterrupt, not by the watchdog that cuts a hung clean-up short.
        assert proc.returncode == -signal.SIGINT, _output(tmp_path, 20000)
        wait_until(lambda: not _children_of(tmp_path), 30, "every child process to exit")
    finally:
        _cleanup(proc, tmp_path)


def _pid(workdir, needle):
    """The live child of the run whose command line contains `needle`."""
    return wait_until(
        lambda: next(
            (
                pid
                for pid in _children_of(workdir)
                if needle in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            ),
            None,
        ),
        120,
        f"a process with {needle!r}",
    )


def _events(workdir, kind):
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def _flushing_after_the_last_step(workdir, steps, learner):
    """A learner's timeline: its last step is done and its last record is the final flush."""
    path = workdir / "timeline" / f"learner_{learner}.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return (
        records
        and records[-1]["state"] == "blocked"
        and any(r.get("step") == steps for r in records)
    )


def test_outside_kills_of_a_learner_the_syncer_and_a_flushing_learner_are_healed(tmp_path):
    """SIGKILL from outside, no fault schedule: learner 1 mid-run, the syncer, then learner 1
    again after its last step, while its final flush waits on a stopped syncer. Each is restarted
    (the learner from its checkpoints, the syncer from its write-ahead log) and the run ends."""
    steps = 160
    # Learner 1 is slowed 30x (~0.2 s a step instead of ~7 ms), so that each kill lands where it
    # is meant to: at full speed a learner ran its 160 steps in 2 s, and was done before the kill.
    proc = _launch(
        tmp_path,
        f"--config.train_steps={steps}",
        "--config.checkpoint.every=20",
        "--config.slow_learner=1",
        "--config.slowdown=30",
        # Static shards: each kill lands at a step of learner 1's own share (its end is known);
        # SIGKILLs from outside on data leases: tests/test_elastic.py.
        "--config.decoupled.data_shards=0",
    )
    try:
        port_file = tmp_path / "syncer.port"
        wait_until(port_file.exists, 120, "the syncer's port file")
        client = SyncerClient(
            f"127.0.0.1:{port_file.read_text()}", config_lib.SyncerConfig(), TOKEN
        )

        def steps_of(i):
            try:
                return client.status()["learners"].get(str(i), {}).get("step", 0)
            except Exception:  # noqa: BLE001 - the syncer is down or stopped for a moment
                return 0

        wait_until(lambda: steps_of(1) > 20, 240, "learner 1 past its first checkpoint")
        os.kill(_pid(tmp_path, "--learner_id=1"), signal.SIGKILL)
        wait_until(lambda: _events(tmp_path, "recovery"), 120, "learner 1's restart")
        os.kill(_pid(tmp_path, "decoupled_diloco.syncer"), signal.SIGKILL)
        wait_until(lambda: len(_events(tmp_path, "recovery")) >= 2, 120, "the syncer's restart")
        wait_until(lambda: steps_of(1) >= steps - 30, 300, "learner 1 near its end")
        syncer = _pid(tmp_path, "decoupled_diloco.syncer")
        os.kill(syncer, signal.SIGSTOP)  # learner 1's final flush now waits
        try:
            wait_until(
                lambda: _flushing_after_the_last_step(tmp_path, steps, 1), 300, "learner 1's flush"
            )
            os.kill(_pid(tmp_path, "--learner_id=1"), signal.SIGKILL)
        finally:
            os.kill(syncer, signal.SIGCONT)
        client.close()
        proc.wait(timeout=600)
        assert proc.returncode == 0, _output(tmp_path)
        summary = json.loads((tmp_path / "summary.json").read_text())
        crashes = _events(tmp_path, "crash")
        assert [c["process"] for c in crashes] == ["learner_1", "syncer", "learner_1"], crashes
        assert all(c["code"] == -signal.SIGKILL for c in crashes)
        assert summary["recoveries"] == 3 and summary["failures_injected"] == 0
        learners = {x["learner_id"]: x for x in summary["learners"]}
        assert all(x["steps"] == steps for x in learners.values())
        assert learners[1]["restored_from_step"] == steps  # restarted after its last step
        assert learners[1]["restarts"] == 2
        assert summary["final_eval_loss"] < 5.3  # ln 256 = 5.55 at init
        wait_until(lambda: not _children_of(tmp_path), 30, "every child process to exit")
    finally:
        _cleanup(proc, tmp_path)
