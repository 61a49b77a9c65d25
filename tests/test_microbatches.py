"""Gradient accumulation: N microbatches of B give the update of one batch of N*B."""

import jax
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.island import Island
from decoupled_diloco.planning import plan
from tests.conftest import tiny_config


def _step(config, devices, batch):
    island = Island(config, devices)
    state = island.init(seed=0)
    state, loss = island.step(state, batch)
    return jax.device_get(state.params), float(loss), island


@pytest.mark.parametrize("mesh", [(1, 1), (2, 1)])
def test_microbatches_give_the_update_of_the_whole_batch(corpus, mesh):
    config = tiny_config(**{"data.batch_size": 8, "mesh.shape": mesh})
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, size=(8, config.model.seq_len + 1), dtype=np.int32)
    devices = jax.devices()[: mesh[0] * mesh[1]]
    whole, whole_loss, _ = _step(config, devices, batch)
    micro_config = config_lib.replace(config, **{"optim.microbatches": 2})
    micro, micro_loss, island = _step(micro_config, devices, batch)
    assert island.trace_count == 1
    assert micro_loss == pytest.approx(whole_loss, rel=1e-5)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(micro), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


def test_the_memory_plan_counts_one_microbatch_of_activations():
    config = tiny_config(**{"data.batch_size": 32, "model.seq_len": 128, "model.d_model": 64})
    batch = jax.ShapeDtypeStruct((32, 129), np.int32)
    whole = plan(Island(config, jax.devices()[:1]), batch)
    micro = plan(
        Island(config_lib.replace(config, **{"optim.microbatches": 4}), jax.devices()[:1]), batch
    )
    assert micro.temp < whole.temp / 2, (micro.temp, whole.temp)


def test_microbatches_that_cannot_split_the_batch_are_refused():
    with pytest.raises(config_lib.ConfigError, match="optim.microbatches: 3 microbatches"):
        tiny_config(**{"optim.microbatches": 3})
    with pytest.raises(config_lib.ConfigError, match="a microbatch of 2 rows"):
        tiny_config(**{"optim.microbatches": 4, "mesh.shape": (4, 1), "num_learners": 1})
    with pytest.raises(config_lib.ConfigError, match="optim.microbatches: must be >= 1"):
        tiny_config(**{"optim.microbatches": 0})
