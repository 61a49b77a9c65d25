"""The synchronous modes against references."""

import jax
import numpy as np

from decoupled_diloco.data import text as data
from decoupled_diloco.island import Island
from decoupled_diloco.train import build_trainer, train_and_evaluate
from tests.conftest import tiny_config


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_one_learner_h1_outer_sgd_lr1_equals_plain_training(corpus):
    sgd1 = {"outer.lr": 1.0, "outer.momentum": 0.0, "outer.nesterov": False}
    diloco_cfg = tiny_config(num_learners=1, inner_steps=1, train_steps=6, **sgd1)
    dp_cfg = tiny_config(mode="dp", num_learners=1, inner_steps=1, train_steps=6)
    devices = jax.devices()[:1]
    diloco = build_trainer(diloco_cfg, corpus, devices)
    plain = build_trainer(dp_cfg, corpus, devices)
    for step in range(1, 7):
        diloco.step(step)
        plain.step(step)
    assert diloco.syncs == 6
    for got, want in zip(
        _leaves(diloco.global_params()), _leaves(plain.global_params()), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-7)


def test_two_islands_on_disjoint_meshes_match_a_single_process_reference(corpus):
    lr, mu, steps = 0.7, 0.9, 3
    config = tiny_config(
        num_learners=2,
        inner_steps=steps,
        train_steps=steps,
        **{"mesh.shape": (2, 2), "outer.lr": lr, "outer.momentum": mu},
    )
    trainer = build_trainer(config, corpus, jax.devices())
    assert [sorted(d.id for d in i.mesh.devices.flat) for i in trainer.islands] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    for step in range(1, steps + 1):
        trainer.step(step)
    assert trainer.syncs == 1
    for state in trainer.states:  # every island restarts from the new global parameters
        for got, want in zip(_leaves(state.params), _leaves(trainer.global_params()), strict=True):
            np.testing.assert_array_equal(got, want)

    # Reference: each learner trained alone on one device, then the outer step in numpy.
    ref_island = Island(config, jax.devices()[:1], mesh_shape=(1, 1))
    anchor = _leaves(ref_island.init(config.seed).params)
    locals_ = []
    for learner in range(2):
        it = data.train_iterator(
            corpus.train_BN, config.model.seq_len, config.data.batch_size, learner, 2, config.seed
        )
        state = ref_island.init(config.seed)
        for _ in range(steps):
            state, _ = ref_island.step(state, next(it))
        locals_.append(_leaves(state.params))
    for i, got in enumerate(_leaves(trainer.global_params())):
        delta = np.mean([anchor[i] - loc[i] for loc in locals_], axis=0)
        momentum = delta  # first outer step: m = Δ
        want = anchor[i] - lr * (delta + mu * momentum)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_dp_evaluates_when_learners_do_not_divide_the_eval_batch(corpus):
    # 3 learners: dp's data axis is 3 wide, the held-out batches have 8 rows.
    config = tiny_config(mode="dp", num_learners=3, train_steps=2, **{"eval.every": 1})
    result = train_and_evaluate(config, None, devices=jax.devices()[:4], corpus=corpus)
    assert np.isfinite(result.summary["final_eval_loss"])


def test_diloco_and_dp_learn(corpus, tmp_path):
    for mode in ("dp", "diloco"):
        config = tiny_config(mode=mode, train_steps=16, inner_steps=4, **{"eval.every": 8})
        result = train_and_evaluate(config, tmp_path / mode, corpus=corpus)
        s = result.summary
        assert s["mode"] == mode and s["tokens"] == 16 * 2 * 8 * 32
        assert s["final_eval_loss"] < 4.5  # ln(256) = 5.55 at init
        lines = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
        assert len(lines) >= 4 and '"eval_loss"' in lines[-1]
        assert (tmp_path / mode / "summary.json").exists()
