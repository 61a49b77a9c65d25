"""One outer round for every mode: the `diloco` trainer and the syncer give the same result."""

import jax
import numpy as np
import pytest

from decoupled_diloco.core import fragments as F
from decoupled_diloco.core import outer
from decoupled_diloco.syncer.records import Push
from decoupled_diloco.syncer.server import initial_fragments
from decoupled_diloco.syncer.state import SyncerState
from decoupled_diloco.tasks import make_task
from decoupled_diloco.trainers import DiLoCoTrainer
from tests.conftest import tiny_config


@pytest.mark.parametrize("method", ["mean", "rda"])
def test_the_diloco_trainer_and_the_syncer_merge_the_same_pushes_alike(method):
    config = tiny_config(
        mode="diloco",
        inner_steps=4,
        **{"outer.merge": method, "decoupled.fragments": 3, "decoupled.quorum": 2},
    )
    trainer = DiLoCoTrainer(config, jax.devices()[:2], [], None)
    anchor = trainer.anchor
    rng = np.random.default_rng(0)
    local = [
        jax.tree.map(lambda x: x + rng.normal(size=x.shape).astype(x.dtype) * 0.01, anchor)
        for _ in range(2)
    ]
    for i, island in enumerate(trainer.islands):
        trainer.states[i] = trainer.states[i]._replace(params=island.put_params(local[i]))
    trainer.sync()  # the synchronous round: all of the model, both learners

    # The syncer: the same initial values, the same outer gradients, pushed fragment by fragment.
    cut, values = initial_fragments(config)
    for frag, frag_values in zip(cut, values, strict=True):
        leaves = jax.tree.leaves(anchor)
        for spec, value in zip(frag, frag_values, strict=True):
            np.testing.assert_array_equal(value, leaves[spec.index])  # the same start
    task = make_task(config)
    state = SyncerState(config, cut, values, is_mean_only=task.is_mean_only)
    steps, tokens = (
        config.inner_steps,
        config.inner_steps * task.tokens_per_step(config.data.batch_size),
    )
    for i in range(2):
        state.register(i, "1x1")
    for i in range(2):
        leaves = [np.asarray(x) for x in jax.tree.leaves(local[i])]
        anchors = jax.tree.leaves(anchor)
        for p, frag in enumerate(cut):
            delta = outer.outer_gradient(F.gather(anchors, frag), F.gather(leaves, frag))
            assert state.push(Push(i, p, 0, 0, steps, tokens, delta)).accepted
    assert [f.version for f in state.fragments] == [1, 1, 1]  # both pushed: merged at once
    want = jax.tree.leaves(trainer.anchor)
    for frag, fragment in zip(cut, state.fragments, strict=True):
        for spec, got in zip(frag, fragment.values, strict=True):
            np.testing.assert_allclose(got, want[spec.index], rtol=1e-6, atol=1e-7)
    # RDA keeps the embedding tables on the plain mean: the task says which ones.
    names = [s.name for s in F.tensor_specs(anchor)]
    assert any(task.is_mean_only(n) for n in names) and not all(map(task.is_mean_only, names))
