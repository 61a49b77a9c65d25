"""Multi-process islands: each learner island is 2 processes on JAX's distributed runtime.

Real processes on 127.0.0.1: a syncer, and per island a leader plus a second process joined by
`jax.distributed` with gloo collectives. Waits use generous deadlines on step counts, never
fixed sleeps, and every process is reaped even when a test fails.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.learner.multihost import ProcessGroup, local_device_count
from decoupled_diloco.local import commands
from tests.helpers import ROOT, assert_budget_trained_once, popen_logged, tail, wait_until

TOKEN = "multihost-test-token"
# Overrides of experiments/configs/tiny_lm.py: a tiny model, islands of 2 devices x 2 processes.
TINY_VALUES = {
    "mode": "decoupled",
    "model.d_model": 32,
    "model.mlp_hidden": 64,
    "model.num_layers": 1,
    "model.seq_len": 32,
    "data.batch_size": 8,
    "inner_steps": 8,
    "eval.every": 0,
    "eval.batches": 2,
    "checkpoint.every": 8,  # learner checkpoints: written (and restored) collectively
    "log_every": 8,
    "mesh.shape": (2, 1),
    "decoupled.island_processes": 2,
}
TINY = ["--config=experiments/configs/tiny_lm.py"] + [
    f"--config.{k}={v}".replace(" ", "") for k, v in TINY_VALUES.items()
]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DD_RUN_TOKEN"] = TOKEN
    return env


def test_process_group_and_config_are_checked():
    assert ProcessGroup("h:1", 2, 0).is_leader and not ProcessGroup("h:1", 2, 1).is_leader
    with pytest.raises(ValueError, match="process_id must be in"):
        ProcessGroup("h:1", 2, 2)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ProcessGroup("nohost", 2, 1)
    assert local_device_count(4, 2) == 2
    with pytest.raises(ValueError, match="does not split evenly over 2"):
        local_device_count(3, 2)
    base = config_lib.ExperimentConfig(mode="decoupled")
    with pytest.raises(config_lib.ConfigError, match="island_processes"):
        config_lib.validate(config_lib.replace(base, **{"decoupled.island_processes": 2}))
    with pytest.raises(config_lib.ConfigError, match="dynamic_local_updates"):
        config_lib.validate(
            config_lib.replace(
                base,
                **{
                    "mesh.shape": (2, 1),
                    "decoupled.island_processes": 2,
                    "decoupled.dynamic_local_updates": True,
                },
            )
        )


def test_island_commands_give_each_process_its_place(tmp_path):
    config = config_lib.replace(
        config_lib.ExperimentConfig(mode="decoupled"),
        **{"mesh.shape": (2, 1), "decoupled.island_processes": 2},
    )
    summary = tmp_path / "learner_1.json"
    cmds = commands.island_commands(config, tmp_path / "c.py", "127.0.0.1:5", 1, summary)
    assert [name for name, _ in cmds] == ["learner_1", "learner_1_p1"]
    flags = [dict(a[2:].split("=", 1) for a in cmd if a.startswith("--")) for _, cmd in cmds]
    assert flags[0]["coordinator"] == flags[1]["coordinator"]
    assert [f["process_id"] for f in flags] == ["0", "1"]
    assert {f["num_processes"] for f in flags} == {"2"} and {f["learner_id"] for f in flags} == {
        "1"
    }
    assert flags[0]["summary"] == str(summary)
    assert flags[1]["summary"] == str(tmp_path / "learner_1_p1.json")


def _pids(workdir, *needles):
    """Live processes of this run whose command line contains every needle."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(workdir) in cmdline and all(n in cmdline for n in needles):
            found.append(int(proc.name))
    return found


@pytest.mark.multiprocess
def test_multihost_islands_train_to_the_end_and_losing_one_process_restarts_only_its_island(
    tmp_path,
):
    """Two islands of two processes through the launcher. One process of island 1 is killed
    from outside: its leader goes down with it, the supervisor restarts both, they restore the
    island's checkpoint collectively and rejoin, while island 0 trains on untouched; the run
    then ends with both processes of each island in lockstep."""
    steps = 64
    proc = popen_logged(
        [
            sys.executable,
            "-m",
            "experiments.train",
            f"--workdir={tmp_path}",
            *TINY,
            f"--config.train_steps={steps}",
        ],
        tmp_path / "launcher.log",
        cwd=ROOT,
        env=_env(),
    )
    client = None
    try:
        port_file = tmp_path / "syncer.port"
        wait_until(port_file.exists, 180, "the syncer's port file")
        client = SyncerClient(
            f"127.0.0.1:{port_file.read_text()}", config_lib.SyncerConfig(), TOKEN
        )

        def steps_of():
            learners = client.status()["learners"]
            return [learners.get(str(i), {}).get("step", 0) for i in range(2)]

        wait_until(lambda: min(steps_of()) >= 16, 240, "both islands to train")
        victim = wait_until(
            lambda: _pids(tmp_path, "--learner_id=1", "--process_id=1"), 30, "island 1's p1"
        )
        os.kill(victim[0], 9)
        proc.wait(timeout=600)
        assert proc.returncode == 0, tail(tmp_path / "launcher.log")
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    crashes = [e["process"] for e in events if e.get("event") == "crash"]
    restarted = sorted(e["process"] for e in events if e.get("event") == "recovery")
    # The death is noticed on the killed process, or on its leader if that fell first.
    assert len(crashes) == 1 and crashes[0] in ("learner_1", "learner_1_p1"), crashes
    assert restarted == ["learner_1", "learner_1_p1"]  # island 0 was never restarted
    logs = tmp_path / "logs"
    assert (logs / "learner_0.log").read_text().count("joined at versions") == 1
    island_1 = (logs / "learner_1.log").read_text()
    assert island_1.count("joined at versions") == 2  # it rejoined ...
    restored = [x for x in island_1.splitlines() if "restored step" in x]  # ... from its checkpoint
    assert restored and int(restored[-1].split("restored step ")[1].split()[0]) >= 8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_eval_loss"] < 5.0  # ln(256) = 5.55 at init
    assert summary["outer_syncs"] >= 4 and summary["recoveries"] == 2
    # On data leases, asked by each island's leader for all its processes: the budget once.
    assert_budget_trained_once(summary, learners=2)
    for i in range(2):
        leader = json.loads((tmp_path / f"learner_{i}.json").read_text())
        other = json.loads((tmp_path / f"learner_{i}_p1.json").read_text())
        assert (leader["process_id"], other["process_id"]) == (0, 1)
        assert leader["steps"] == other["steps"] > 0 and not leader["errors"]
        # The same merges at the same steps, and bit-identical parameters after each one.
        # (On data leases island 0 may train most of the budget while island 1 restarts: the
        # restarted incarnation's summary can hold few merges, even none.)
        assert len(leader["merge_digests"]) >= (2 if i == 0 else 0)
        assert leader["merge_digests"] == other["merge_digests"]
        assert leader["versions"] == other["versions"] and min(leader["versions"]) >= 1
        assert other["pushes"] == dict(accepted=0, late=0, duplicate=0, covered=0)  # (leader)
        assert other["pushes_unsent"] == other["pushes_dropped"] == 0 and not other["errors"]
        # One checkpoint per island, written by both processes together (each its shards).
        assert (tmp_path / "checkpoints" / f"learner_{i}" / str(leader["steps"])).is_dir()
    assert not _pids(tmp_path, "decoupled_diloco")  # every child reaped


def _tiny_config(**overrides):
    """The config that TINY's flags describe, plus `overrides`."""
    from experiments.configs import tiny_lm

    base = config_lib.from_config_dict(tiny_lm.get_config())
    return config_lib.replace(base, **{**TINY_VALUES, **overrides})


CHECKPOINT_WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from decoupled_diloco.learner import multihost
    from decoupled_diloco.runtime import configure_cpu_devices

    pid, coordinator, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    configure_cpu_devices(2)
    group = multihost.ProcessGroup(coordinator, 2, pid)
    multihost.initialize(group)
    import jax
    from decoupled_diloco import config as config_lib
    from decoupled_diloco.checkpointing import IslandCheckpointer
    from decoupled_diloco.island import Island

    config = config_lib.replace(
        config_lib.ExperimentConfig(),
        **{"model.d_model": 32, "model.mlp_hidden": 64, "model.num_layers": 1,
           "model.seq_len": 32, "data.batch_size": 8, "mesh.shape": (2, 2)},
    )
    island = Island(config, jax.devices(), mesh_shape=(2, 2))  # shards on both processes
    state = island.init(0)
    batch = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.int32)
    state, loss = island.step(state, multihost.put_global(batch, island.batch_sharding))
    ckpt = IslandCheckpointer(directory)
    ckpt.save(1, state, {"step": 1})  # collective: each process writes its own shards
    ckpt.close()
    restored = IslandCheckpointer(directory).restore_latest(island.abstract_state)
    step, back, meta = restored
    same = all(
        np.array_equal(a, b)
        for a, b in zip(multihost.to_host(jax.tree.leaves(state)),
                        multihost.to_host(jax.tree.leaves(back)), strict=True)
    )
    print(f"RESULT {pid} step={step} meta={meta['step']} same={same} loss={float(loss):.6f}",
          flush=True)
    """
)


@pytest.mark.multiprocess
def test_multihost_island_checkpoint_is_written_and_restored_collectively(tmp_path):
    from decoupled_diloco.local.procs import free_port, reap

    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", CHECKPOINT_WORKER, str(i), coordinator, str(tmp_path / "ck")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [w.communicate(timeout=400)[0] for w in workers]
    finally:
        reap(workers)
    for i, (w, out) in enumerate(zip(workers, outs, strict=True)):
        assert w.returncode == 0, out[-3000:]
        result = [x for x in out.splitlines() if x.startswith("RESULT")]
        assert result and f"RESULT {i} step=1 meta=1 same=True" in result[0], out[-2000:]
    # Both processes computed the same (replicated) loss of the one global step.
    assert outs[0].split("loss=")[1].split()[0] == outs[1].split("loss=")[1].split()[0]
    assert (tmp_path / "ck" / "1").is_dir()
