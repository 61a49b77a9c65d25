"""Bring your own model: a user's nnx model, loss, optimizer, data and loop, in every mode.

The user's code is `experiments/examples/` (a BatchNorm + Dropout CNN, a nanoGPT-style byte LM
with its own loop), used through the public API only (`import decoupled_diloco as dd`); the
processes are real (`python -m experiments.train`, `python -m decoupled_diloco.syncer`, the
example's own learner script), and every one of them is reaped.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys

import grpc
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import decoupled_diloco as dd
from experiments.examples import mnist_cnn, own_loop
from tests.helpers import ROOT, popen_logged, wait_until

STEPS = 20


class TinyNet(nnx.Module):
    """An MLP with BatchNorm and Dropout on flattened 8x8 digits: compiles in a moment."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, images):
        x = nnx.relu(self.norm(self.hidden(images.reshape(images.shape[0], -1))))
        return self.out(self.dropout(x))


def tiny_task(data, policy="average"):
    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return dd.Task.from_nnx(lambda rngs: TinyNet(rngs), loss, dataset=data, state_policy=policy)


@pytest.fixture(scope="module")
def cnn_config():
    return mnist_cnn.make_config("dp", steps=STEPS, log_every=10, eval=dd.EvalConfig(every=10))


@pytest.fixture(scope="module")
def cnn_task(cnn_config):
    return mnist_cnn.make_task(cnn_config)


def test_user_cnn_trains_in_one_process_and_its_metrics_reach_the_summary(
    tmp_path, cnn_config, cnn_task
):
    result = dd.train_and_evaluate(
        cnn_config,
        tmp_path,
        task=cnn_task,
        inner_optimizer=mnist_cnn.optimizer(cnn_config),
        dataset=cnn_task.dataset,
    )
    s = result.summary
    # The loss, the loss's aux (nll) and metrics_fn's accuracy, in the summary and the metrics.
    assert s["final_eval_accuracy"] > 0.5 and 0 < s["final_eval_nll"] < s["final_eval_loss"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"eval_loss", "eval_accuracy", "eval_nll"} <= set(lines[-1])
    # A "token" is what the task says: here an image.
    assert s["token_unit"] == "images" and s["tokens"] == STEPS * 2 * cnn_config.data.batch_size
    assert s["task"] == "CNN" and s["dataset"]["name"] == "digits"
    # The user's model was trained: its tree (with BatchNorm statistics) is what came back.
    assert set(result.params) == {"conv1", "norm1", "conv2", "norm2", "hidden", "out"}
    assert set(result.params["norm1"]) == {"scale", "bias", "mean", "var"}


def test_the_outer_round_averages_batch_statistics_and_steps_parameters(cnn_config, cnn_task):
    config = dd.replace(cnn_config, **{"outer.lr": 0.7, "outer.momentum": 0.9})
    task = tiny_task(cnn_task.dataset)
    outer = dd.DiLoCoOuter(config, task)
    global_params = task.init_params(0)
    state = outer.init(global_params)
    rng = np.random.default_rng(0)
    local = [
        jax.tree.map(lambda x: x + rng.normal(size=x.shape).astype(x.dtype), global_params)
        for _ in range(2)
    ]
    new, _ = outer.update(global_params, state, local)
    for name in ("mean", "var"):  # state: the plain mean of the two learners' values
        want = (local[0]["norm"][name] + local[1]["norm"][name]) / 2
        np.testing.assert_allclose(new["norm"][name], want, rtol=1e-5, atol=1e-6)
    # Parameters take the outer step (lr 0.7, Nesterov): not the plain mean.
    mean_kernel = (local[0]["hidden"]["kernel"] + local[1]["hidden"]["kernel"]) / 2
    assert not np.allclose(new["hidden"]["kernel"], mean_kernel, atol=1e-3)


@pytest.mark.parametrize("policy", ["average", "local"])
def test_batch_statistics_follow_the_policy_in_diloco(policy, cnn_config, cnn_task):
    config = dd.replace(cnn_config, mode="diloco", inner_steps=5, train_steps=5)
    task = tiny_task(cnn_task.dataset, policy)
    trainer = dd.DiLoCoTrainer(
        config,
        jax.devices()[:2],
        [task.dataset.train_iterator(32, i, 2, 0) for i in range(2)],
        None,
        task=task,
    )
    for step in range(1, 6):
        trainer.step(step)  # the fifth step ends the round: the outer step ran
    assert trainer.syncs == 1
    stats = [jax.device_get(s.params if policy == "average" else s.local) for s in trainer.states]
    if policy == "average":  # synced: equal on both learners, and what the global model holds
        for s in stats:
            np.testing.assert_array_equal(s["norm"]["var"], trainer.global_params()["norm"]["var"])
    else:  # kept per learner: never merged, never dropped
        assert "mean" not in trainer.global_params()["norm"]
        assert not np.allclose(stats[0]["norm"]["var"], stats[1]["norm"]["var"])
        assert not np.allclose(stats[0]["norm"]["var"], 1.0)  # moved from the init
    keys = [jax.device_get(s.local)["dropout"]["rngs"]["key"] for s in trainer.states]
    assert not np.array_equal(keys[0], keys[1])  # RNG state: each learner its own stream


def test_a_user_task_resumes_bit_exactly_with_its_state(tmp_path, cnn_config, cnn_task):
    """Checkpoints hold the synced statistics, the per-learner RNG state and the grain position."""
    config = dd.replace(
        cnn_config, mode="diloco", inner_steps=5, train_steps=10, **{"checkpoint.every": 5}
    )
    task = tiny_task(cnn_task.dataset)
    dd.train_and_evaluate(config, tmp_path / "cut", task=task, stop_after=5)
    resumed = dd.train_and_evaluate(config, tmp_path / "cut", task=task)
    whole = dd.train_and_evaluate(config, tmp_path / "whole", task=task)
    assert resumed.summary["resumed_from_step"] == 5
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(a, b)


class _Generator:
    """A dataset whose training iterator is a plain generator (no get_state / set_state)."""

    def __init__(self, data):
        self.data = data

    def train_iterator(self, batch_size, learner_id, num_learners, seed):
        def batches():
            rng = np.random.default_rng(seed + learner_id)
            while True:
                idx = rng.integers(0, len(self.data.train), batch_size)
                yield {
                    "image": np.stack([self.data.train[i]["image"] for i in idx]),
                    "label": np.array([self.data.train[i]["label"] for i in idx]),
                }

        return batches()

    def validation_batches(self, batch_size, num_batches):
        return self.data.validation_batches(batch_size, num_batches)


def test_a_dataset_that_cannot_be_checkpointed_is_reported_at_start(tmp_path, cnn_config, cnn_task):
    data = _Generator(cnn_task.dataset)
    config = dd.replace(cnn_config, **{"checkpoint.every": 5, "train_steps": 5})
    with pytest.raises(dd.ConfigError, match=r"checkpoint.every=5.*generator.*get_state"):
        dd.train_and_evaluate(config, tmp_path / "ckpt", task=cnn_task, dataset=data)
    assert not (tmp_path / "ckpt" / "metrics.jsonl").exists()  # before the first step
    # Without checkpoints the same generator trains.
    config = dd.replace(config, **{"checkpoint.every": 0})
    result = dd.train_and_evaluate(config, tmp_path / "plain", task=cnn_task, dataset=data)
    assert result.summary["steps_done"] == 5 and result.summary["dataset"]["name"] == "_Generator"


def test_a_task_that_cannot_travel_is_refused_before_anything_starts(tmp_path, cnn_config):
    task = dataclasses.replace(mnist_cnn.make_task(cnn_config), import_path="")
    config = dataclasses.replace(cnn_config, mode="decoupled", task="")
    with pytest.raises(
        dd.ConfigError, match=r"no import path.*config.task='mypkg.tasks:make_task'"
    ):
        dd.train_and_evaluate(config, tmp_path, task=task)
    config = dd.replace(config, task=mnist_cnn.TASK)
    with pytest.raises(dd.ConfigError, match="cannot receive Python objects"):
        dd.train_and_evaluate(config, tmp_path, inner_optimizer=optax.sgd(0.1))
    assert not (tmp_path / "logs").exists()  # no process was started
    # In one process, a user's task without data is refused (config.data is the built-ins').
    bare = dataclasses.replace(task, dataset=None)
    with pytest.raises(dd.ConfigError, match="carries no dataset"):
        dd.train_and_evaluate(dd.ExperimentConfig(mode="dp", num_learners=1), None, task=bare)


def test_config_checks_of_built_in_models_skip_a_user_task():
    user = dd.ExperimentConfig(task=own_loop.TASK, model=dd.ModelConfig(num_heads=3))
    dd.validate(user)  # 128 / 3 heads would be refused for the built-in transformer
    with pytest.raises(dd.ConfigError, match="num_heads"):
        dd.validate(dataclasses.replace(user, task=""))
    with pytest.raises(dd.ConfigError, match=r"config.task: 'nocolon' is not 'module:function'"):
        dd.validate(dataclasses.replace(user, task="nocolon"))
    with pytest.raises(dd.ConfigError, match="cannot import module 'no_such_module'"):
        dd.make_task(dataclasses.replace(user, task="no_such_module:make_task"))


def test_a_learner_of_another_task_is_refused_at_registration():
    config = dd.from_config_dict(own_loop.get_config())
    config = dd.replace(config, **{"decoupled.syncer.token": "t"})
    server = dd.SyncerServer(config, port=0).start()
    try:
        address = f"127.0.0.1:{server.port}"
        assert server.fingerprint.startswith(own_loop.TASK + "@")
        builtin = dd.replace(config, task="")  # the built-in transformer: another task
        params = dd.make_task(builtin).init_params(0)
        sync = dd.DecoupledSync(builtin, learner_id=0, syncer=address, params=params)
        with pytest.raises(grpc.RpcError) as info:
            sync.connect(timeout_s=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = info.value.details()
        assert "'builtin:transformer'" in details and repr(own_loop.TASK) in details, details
        sync.close()
        # The same task with another tree (a longer context: a bigger position table).
        wider = dd.replace(config, **{"model.seq_len": 128})
        params = dd.make_task(wider).init_params(0)
        sync = dd.DecoupledSync(wider, learner_id=0, syncer=address, params=params)
        with pytest.raises(grpc.RpcError, match="different parameter tree"):
            sync.connect(timeout_s=30)
        sync.close()
        assert server.state.learners == {}
    finally:
        server.stop()


def test_the_syncer_starts_from_given_initial_parameters():
    config = dd.from_config_dict(own_loop.get_config())
    task = dd.make_task(config)
    initial = jax.tree.map(lambda x: np.full_like(x, 0.5), task.init_params(0))
    server = dd.SyncerServer(config, port=0, token="t", task=task, initial_params=initial)
    try:
        assert all(np.all(v == 0.5) for f in server.state.fragments for v in f.values)
    finally:
        server.stop()
    initial["tokens"]["embedding"] = initial["tokens"]["embedding"][:10]
    with pytest.raises(ValueError, match="does not match task"):
        dd.SyncerServer(config, port=0, token="t", task=task, initial_params=initial)


def test_muon_as_the_inner_optimizer_of_the_built_in_lm():
    config = dd.ExperimentConfig(
        mode="diloco",
        num_learners=1,
        train_steps=10,
        optim=dd.OptimConfig(name="muon", lr=0.02, warmup_steps=1),
        model=dd.ModelConfig(d_model=32, num_layers=1, num_heads=2, mlp_hidden=64, seq_len=16),
        data=dd.DataConfig(batch_size=4),
    )
    island = dd.Island(config, jax.devices()[:1])
    assert "muon" in repr(island.abstract_state.opt_state).lower()
    state = island.init(0)
    batch = np.random.default_rng(0).integers(0, 8, (4, 17)).astype(np.int32)
    losses = []
    for _ in range(10):
        state, loss = island.step(state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses  # it learns (a repeated batch of 8 symbols)


# Through real processes ----------------------------------------------------------------------


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["DD_RUN_TOKEN"] = "byom-test-token"
    return env


def _reap(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.multiprocess
def test_user_cnn_in_decoupled_mode_from_the_command_line(tmp_path):
    args = ["--config=experiments/examples/mnist_cnn.py:decoupled", "--config.train_steps=40"]
    command = [sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--nohints"]
    proc = subprocess.Popen(
        command + args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out = proc.communicate(timeout=300)[0].decode(errors="replace")
        assert proc.returncode == 0, out[-3000:]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["task"] == mnist_cnn.TASK and summary["final_eval_accuracy"] > 0.2
        assert summary["token_unit"] == "images" and "images in" in out
        assert summary["outer_syncs"] >= 4
        # The syncer held the user's tree: its fingerprint is the CNN task's (names, shapes,
        # dtypes of every tensor, BatchNorm statistics included).
        config = mnist_cnn.make_config("decoupled", steps=40)
        want = dd.make_task(config).fingerprint()
        log = (tmp_path / "logs" / "syncer.log").read_text()
        assert f"fingerprint {want}" in log, log[-2000:]
    finally:
        _reap([proc])


@pytest.mark.multiprocess
def test_own_loop_syncs_through_a_syncer_started_from_the_command_line(tmp_path):
    config_args = ["--config=experiments/examples/own_loop.py", "--config.train_steps=40"]
    port_file = tmp_path / "port"
    procs = []
    try:
        procs.append(
            popen_logged(
                [sys.executable, "-m", "decoupled_diloco.syncer", "--port=0"]
                + [f"--port_file={port_file}", *config_args],
                tmp_path / "syncer.log",
                cwd=ROOT,
                env=_env(),
            )
        )
        wait_until(port_file.exists, 120, "the syncer's port file")
        address = f"127.0.0.1:{port_file.read_text()}"
        for i in range(2):
            command = [sys.executable, "-m", "experiments.examples.own_loop", *config_args]
            procs.append(
                subprocess.Popen(
                    command + [f"--syncer={address}", f"--learner_id={i}"],
                    cwd=ROOT,
                    env=_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        for proc in procs[1:]:
            out = proc.communicate(timeout=300)[0].decode(errors="replace")
            assert proc.returncode == 0, out[-3000:]
            done = re.search(r"done: (\{.*\})", out)
            assert done, out[-2000:]
            result = eval(done.group(1))  # a dict literal of floats and ints
            assert result["last_loss"] < result["first_loss"] - 1.0, result  # the loss falls
            assert sum(result["versions"]) >= 2, result  # merged fragments came back
        # The syncer merged both learners' pushes of every fragment (the final ones included).
        config = dd.from_config_dict(own_loop.get_config())
        client = dd.SyncerClient(address, config.decoupled.syncer, _env()["DD_RUN_TOKEN"])
        status = client.status()
        client.close()
        assert all(f["version"] >= 2 for f in status["fragments"]), status["fragments"]
        assert sorted(status["learners"]) == [0, 1] or len(status["learners"]) == 2
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == 0
    finally:
        _reap(procs)


def test_a_merge_of_batch_statistics_is_not_refused_under_a_small_outer_lr():
    """Statistics move by their mean (rate 1): the merged-step bound allows for it."""
    from decoupled_diloco.syncer.records import Push
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    data = mnist_cnn.ImageData()
    task = tiny_task(data)
    config = dd.replace(
        dd.ExperimentConfig(mode="decoupled", num_learners=1, train_steps=10),
        **{"outer.lr": 0.01, "outer.momentum": 0.0, "decoupled.fragments": 1},
    )
    cut, values = initial_fragments(config, task)
    state = SyncerState(config, cut, values, is_averaged=task.is_averaged)
    _, incarnation = state.register(0, "1x1")
    var = [i for i, s in enumerate(cut[0]) if s.name == "norm/var"][0]
    delta = [np.zeros_like(v) for v in values[0]]
    delta[var] = values[0][var] * 0.9  # the learner's variances are a tenth of the initial ones
    result = state.push(Push(0, 0, 0, 0, 5, 5, delta, incarnation=incarnation))
    assert result.accepted, result
    state.tick()
    frag = state.fragments[0]
    assert frag.version == 1 and frag.merges == 1, frag
    np.testing.assert_allclose(frag.values[var], values[0][var] * 0.1, rtol=1e-6)
