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
    assert island.jitted_step._cache_size() == 1
    declared = jax.tree.leaves(island.state_sharding)
    actual = [x.sharding for x in jax.tree.leaves(state)]
    assert len(declared) == len(actual)
    for want, got, leaf in zip(declared, actual, jax.tree.leaves(state), strict=True):
        assert got.is_equivalent_to(want, leaf.ndim)
    q = state.params["blocks"][0]["attn"]["q"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {d.id for d in q.devices()} == {0, 1, 2, 3}
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


_WIDE = {  # 8 heads of 8 values: every axis choice below splits it
    "model.d_model": 64,
    "model.num_heads": 8,
    "model.mlp_hidden": 128,
    "model.num_layers": 2,
}


@pytest.mark.parametrize(
    "shape, fsdp, remat",
    [((8, 1), True, False), ((1, 8), False, True), ((4, 2), True, True)],
    ids=["fsdp", "tensor+remat", "fsdp+tensor+remat"],
)
def test_every_axis_choice_shards_as_declared_and_compiles_once(
    shape, fsdp, remat, one_device_loss
):
    """Data, FSDP and tensor parallelism over 8 devices: shardings, bytes per device, one
    compilation, and the same loss as one device."""
    from jax.sharding import PartitionSpec as P

    config = tiny_config(**_WIDE, **{"mesh.fsdp": fsdp, "model.remat": remat})
    island = Island(config, jax.devices()[:8], mesh_shape=shape)
    state = island.init(0)
    batch = _batch(island)
    losses = []
    for _ in range(2):
        state, loss = island.step(state, batch)
        losses.append(float(loss))
    assert island.trace_count == 1 and island.jitted_step._cache_size() == 1
    for want, leaf in zip(
        jax.tree.leaves(island.state_sharding), jax.tree.leaves(state), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    attn = state.params["blocks"][0]["attn"]
    data, model = shape
    want_q = P("data" if fsdp and data > 1 else None, "model")
    assert attn["q"]["kernel"].sharding.spec == want_q
    head_dim = 64 // 8
    # Tensor parallel: each device holds whole heads of q (columns head by head).
    assert attn["q"]["kernel"].addressable_shards[0].data.shape[1] % head_dim == 0
    # Moments take their parameter's sharding.
    shape_of = lambda x: (x.shape, x.sharding.spec)  # noqa: E731
    moments = {shape_of(x) for x in jax.tree.leaves(state.opt_state) if x.ndim}
    assert moments == {shape_of(x) for x in jax.tree.leaves(state.params)}
    total = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    on_0 = sum(
        s.data.nbytes
        for x in jax.tree.leaves((state.params, state.opt_state))
        for s in x.addressable_shards
        if s.device == island.mesh.devices.flat[0]
    )
    if fsdp and data * model == 8:  # every tensor of these shapes splits 8 ways
        assert on_0 <= 1.1 * total / 8, (on_0, total)
    elif model == 1:
        assert on_0 == total  # replicated over data
    np.testing.assert_allclose(losses[-1], one_device_loss, rtol=2e-4)


@pytest.fixture(scope="module")
def one_device_loss():
    """The wide model's loss after two steps on one device (what every mesh must match)."""
    one = Island(tiny_config(**_WIDE), jax.devices()[:1], mesh_shape=(1, 1))
    state, batch = one.init(0), _batch(one)
    for _ in range(2):
        state, loss = one.step(state, batch)
    return float(loss)


def test_memory_plan_counts_shards_and_refuses_what_cannot_fit():
    """Per device: parameters and moments / 8 under FSDP; temporaries from the compiled step."""
    from decoupled_diloco import planning
    from decoupled_diloco.config import ConfigError

    replicated = Island(tiny_config(**_WIDE), jax.devices()[:8], mesh_shape=(8, 1))
    sharded = Island(tiny_config(**_WIDE, **{"mesh.fsdp": True}), jax.devices()[:8], (8, 1))
    batch = _batch(replicated)
    a, b = planning.plan(replicated, batch), planning.plan(sharded, batch)
    assert a.temp > 0 and a.batch == batch.nbytes // 8
    assert b.params == a.params // 8 and b.opt_state <= 1.1 * a.opt_state / 8
    assert b.total < a.total
    assert replicated.trace_count == 1  # planning traced the step (and compiled it)
    planning.check(a, limit=0)  # no limit: nothing to refuse
    planning.check(a, limit=a.total)
    with pytest.raises(ConfigError, match=r"GB per device.*mesh\.fsdp=True"):
        planning.check(a, limit=a.total - 1)
    tight = Island(
        tiny_config(**_WIDE, **{"mesh.device_memory_gb": 1e-6}), jax.devices()[:1], (1, 1)
    )
    with pytest.raises(ConfigError, match=r"more than the 0\.00 GB"):
        planning.check_island(tight)  # before anything is allocated or compiled
    assert tight.trace_count == 0
