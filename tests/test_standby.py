"""Warm standby learners: a killed learner restarts by activating a warm spare process.

The multi-process test runs a real syncer, a real learner and a real spare under the real
`Supervisor`, kills the learner with SIGKILL, and waits (never sleeps) for the spare to take
over, restore the checkpoint, rejoin and finish; every process is reaped even on failure.
"""

import json
import signal

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.config import write_config_file
from decoupled_diloco.learner import recovery as learner_recovery
from decoupled_diloco.learner import standby
from decoupled_diloco.local.chaos_run import learner_env, prepare_run
from decoupled_diloco.local.commands import child_env, learner_command, syncer_command
from decoupled_diloco.local.procs import Processes, free_port
from decoupled_diloco.local.supervisor import EventLog, Supervisor
from decoupled_diloco.obs import timeline as tl
from tests.conftest import tiny_config
from tests.helpers import wait_until

STEPS = 300


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"supervisor.standby": -1}, r"config\.supervisor\.standby: must be in \[0, 8\]"),
        ({"supervisor.standby": 9}, r"config\.supervisor\.standby: must be in \[0, 8\]"),
        ({"supervisor.standby": 1, "mode": "dp"}, "need mode 'decoupled'"),
        (
            {
                "supervisor.standby": 1,
                "mode": "decoupled",
                "mesh.shape": (2, 1),
                "decoupled.island_processes": 2,
            },
            "need single-process islands",
        ),
    ],
)
def test_standby_knob_is_validated(overrides, message):
    assert tiny_config(mode="decoupled", **{"supervisor.standby": 2}).supervisor.standby == 2
    with pytest.raises(config_lib.ConfigError, match=message):
        tiny_config(**overrides)


def test_activation_must_match_the_spare_and_startup_counts_from_activation():
    config = tiny_config(mode="decoupled", **{"decoupled.mesh_shapes": "1x1,2x1"})
    own = ["learner", "--config=c.py", "--standby=d", "--mesh_shape=1x1"]
    flags = ["--config=c.py", "--learner_id=0", "--syncer=127.0.0.1:1"]
    assert standby._check_activation({"argv": flags}, own, config, (1, 1)) == flags[1:]
    with pytest.raises(ValueError, match=r"learner 1 needs mesh \(2, 1\)"):
        standby._check_activation({"argv": flags[:1] + ["--learner_id=1"]}, own, config, (1, 1))
    with pytest.raises(ValueError, match="not this spare's"):
        standby._check_activation({"argv": ["--config=other.py"]}, own, config, (1, 1))
    times = {"process_start": 100.0, "standby_ready": 108.0, "activated": 110.0}
    times.update(constructing=110.5, connected=111.0, data_loaded=111.25, restored=111.5)
    line = learner_recovery.startup_line({**times, "first_step": 111.75})
    assert line.startswith("first step 1.75 s after activation of a warm standby (started 10.0")
    assert line.endswith(
        "activation 0.50 s, build+connect 0.50 s, data 0.25 s, "
        "restore or init 0.25 s, first step 0.25 s"
    )
    # Activated before it was ready: the rest of its warm-up is the restarted learner's time.
    late = learner_recovery.startup_line({**times, "standby_ready": 110.25, "first_step": 112})
    assert ": rest of warm-up 0.25 s, activation 0.25 s," in late


@pytest.mark.multiprocess
def test_killed_learner_restarts_from_a_warm_standby(tmp_path):
    # Static shards: the restarted learner ends at STEPS (on data leases it ends where the
    # ledger's budget does, fewer steps when pushes past its checkpoint were accepted).
    overrides = {
        "checkpoint.every": 20, "eval.every": 0, "supervisor.standby": 1,
        "decoupled.data_shards": 0,
    }  # fmt: skip
    config = tiny_config(
        # A user's task (experiments/examples/mnist_cnn.py: BatchNorm, dropout, grain data),
        # imported by the spare, the learner and the syncer from `config.task`.
        task="experiments.examples.mnist_cnn:make_task",
        mode="decoupled",
        num_learners=1,
        train_steps=STEPS,
        inner_steps=8,
        log_every=100,
        **overrides,
    )
    config, chaos_env, _ = prepare_run(config, tmp_path)
    config_file = write_config_file(config, tmp_path / "config.py")
    procs = Processes(tmp_path / "logs", {**child_env("standby-test-token"), **chaos_env})
    log = EventLog(tmp_path, 0.0)
    supervisor = Supervisor(procs, tmp_path / "timeline", log)
    spares = standby.Spares(
        procs, tmp_path / "standby", config_file, [(1, 1)], 1, tmp_path / "timeline"
    )
    supervisor.spares = spares
    port = free_port()
    summary = tmp_path / "learner_0.json"
    try:
        syncer_dir = tmp_path / "checkpoints" / "syncer_0"
        supervisor.add(
            "syncer", syncer_command(config_file, tmp_path / "port", port, 0, syncer_dir)
        )
        supervisor.poll()  # no learner is starting: the spare starts now
        spare = spares.pool[(1, 1)][0]
        wait_until(lambda: spare.ready or spare.proc.poll() is not None, 120, "a warm spare")
        assert spare.proc.poll() is None, procs.tail(spare.name)
        command = learner_command(config_file, f"127.0.0.1:{port}", 0, summary)
        first = supervisor.add("learner_0", command, learners=[0], env=learner_env(0))
        supervisor.start_thread()
        saved = tmp_path / "checkpoints" / "learner_0" / "20"  # renamed into place once whole
        wait_until(
            lambda: saved.is_dir() and supervisor.learner_step(0) >= 25, 120, "a saved checkpoint"
        )
        assert supervisor.kill_learner(0, repair_s=0.0)
        wait_until(lambda: supervisor.finished(["learner_0"]) or supervisor.error, 120, "the end")
        supervisor.check()
        assert first.returncode == -signal.SIGKILL
        assert supervisor.children["learner_0"].proc is spare.proc  # the spare became learner 0
        # A new spare replaces it once the restarted learner has stepped; SIGTERM ends it cleanly.
        wait_until(lambda: spares.started == 2, 60, "a replacement spare")
        spare2 = spares.pool[(1, 1)][0]
        wait_until(lambda: spare2.ready or spare2.proc.poll() is not None, 120, "its warm-up")
        spare2.proc.terminate()
        assert spare2.proc.wait(timeout=30) == 0, procs.tail(spare2.name)
    finally:
        supervisor.stop()
        procs.reap()
    result = json.loads(summary.read_text())
    assert result["steps"] == STEPS and result["restarts"] == 1
    assert result["restored_from_step"] >= 20 and result["errors"] == []
    learner_log = (tmp_path / "logs" / "learner_0.log").read_text()
    assert "s after activation of a warm standby" in learner_log
    assert "restored step" in learner_log
    # The real steps reused the step compiled during the warm-up: traced once in that process.
    spare_log = (tmp_path / "logs" / f"{spare.name}.log").read_text()
    assert "inner step traced 1 time(s)" in learner_log + spare_log
    restarts = [e for e in log.events if e["event"] == "recovery"]
    assert [(e["kind"], e["warm_standby"]) for e in restarts] == [("restart", True)]
    # Timeline: the restart's `starting` opens at activation; the spare's warm-up is nobody's.
    records = tl.load(tmp_path / "timeline")[0]
    states = [r.state for r in records]
    assert states[:3] == ["starting", "waiting", "restoring"]
    down = states.index("down")
    assert states[down + 1] == "starting" and records[down + 1].t >= records[down].t
    assert records[down + 2].t >= restarts[0]["time"] - 1.0  # the learner's own records follow
    assert spare.directory.joinpath("ready").exists()
    ready = json.loads(spare.directory.joinpath("ready").read_text())["ready"]
    assert ready < records[down + 1].t  # it warmed up before the restart: no learner's time
    assert not (tmp_path / "timeline" / f"{spare.name}.jsonl").exists()
