"""Islands: declared shardings, one compilation, disjoint meshes, mesh-independent init."""

import jax
import numpy as np
import pytest

from decoupled_diloco.island import Island
from decoupled_diloco.models.mesh import make_island_mesh
from tests.conftest import tiny_config


def _batch(island, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(island.batch_size, island.config.model.seq_len + 1)).astype(
        np.int32
    )


def test_output_shardings_equal_declared_and_step_compiles_once():
    island = Island(tiny_config(), jax.devices()[:4], mesh_shape=(2, 2))
    state = island.init(0)
    for i in range(4):
        state, loss = island.step(state, _batch(island, i))
    assert island.trace_count == 1
    assert island._step._cache_size() == 1
    declared = jax.tree.leaves(island.state_sharding)
    actual = [x.sharding for x in jax.tree.leaves(state)]
    assert len(declared) == len(actual)
    for want, got, leaf in zip(declared, actual, jax.tree.leaves(state), strict=True):
        assert got.is_equivalent_to(want, leaf.ndim)
    qkv = state.params["blocks"][0]["attn"]["qkv"]["kernel"]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {d.id for d in qkv.devices()} == {0, 1, 2, 3}
    assert loss.sharding.is_fully_replicated


def test_islands_use_disjoint_devices_and_init_the_same_params():
    a = Island(tiny_config(), jax.devices()[:2], mesh_shape=(2, 1))
    b = Island(tiny_config(), jax.devices()[4:8], mesh_shape=(2, 2))
    assert not set(a.mesh.devices.flat) & set(b.mesh.devices.flat)
    pa, pb = jax.device_get(a.init(7).params), jax.device_get(b.init(7).params)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(x, y)


def test_mesh_shape_must_match_devices():
    with pytest.raises(ValueError, match=r"config\.mesh\.shape \(2, 2\) needs 4 devices, got 3"):
        make_island_mesh((2, 2), jax.devices()[:3])


def test_a_step_lowers_the_loss_on_a_repeated_batch():
    island = Island(tiny_config(), jax.devices()[:1], mesh_shape=(1, 1))
    state = island.init(0)
    batch = _batch(island)
    losses = []
    for _ in range(6):
        state, loss = island.step(state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1
