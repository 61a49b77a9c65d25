import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from decoupled_diloco import config as config_lib
from decoupled_diloco.core import outer
from decoupled_diloco.island import Island
from decoupled_diloco.models import moe
from decoupled_diloco.models.mesh import make_island_mesh
from decoupled_diloco.models.transformer import Transformer
from decoupled_diloco.tasks import model_config


def _reference_dispatch(experts_GSK, num_experts, capacity):
    """The routing rule in plain Python: all first choices, then all second ones, token order."""
    groups, size, top_k = experts_GSK.shape
    dispatch = np.zeros((groups, size, num_experts, capacity))
    for g in range(groups):
        used = [0] * num_experts
        for k in range(top_k):
            for s in range(size):
                e = experts_GSK[g, s, k]
                if used[e] < capacity:
                    dispatch[g, s, e, used[e]] = 1
                    used[e] += 1
    return dispatch


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.sampled_from([1, 2]),
    num_experts=st.sampled_from([2, 4]),
    capacity=st.integers(1, 6),
    skew=st.floats(0.0, 4.0),
)
def test_routing_respects_capacity(seed, top_k, num_experts, capacity, skew):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(3, 8, num_experts))
    logits[..., 0] += skew  # crowd expert 0 so that capacity binds
    r = moe.route(jnp.asarray(logits), top_k, capacity)
    dispatch, combine = np.asarray(r.dispatch_GSEC), np.asarray(r.combine_GSEC)
    assert dispatch.sum(axis=1).max() <= 1  # a slot holds at most one token
    assert dispatch.sum(axis=(1, 3)).max() <= capacity  # an expert takes at most C tokens
    assert dispatch.sum(axis=(2, 3)).max() <= top_k  # a token goes to at most k experts
    assert np.all((combine > 0) <= (dispatch > 0))  # weights only where dispatched
    experts = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]
    np.testing.assert_array_equal(dispatch, _reference_dispatch(experts, num_experts, capacity))
    claims = top_k * 3 * 8
    assert float(r.dropped) == pytest.approx(1 - dispatch.sum() / claims, abs=1e-6)


def test_aux_loss_is_one_for_uniform_routing_and_grows_with_skew():
    uniform = moe.route(jnp.zeros((2, 16, 4)), top_k=1, capacity=16)
    assert float(uniform.load_balance) == pytest.approx(1.0)
    # Balanced but confident routing is also minimal: f_e = P_e = 1/E.
    balanced = jnp.tile(10.0 * jnp.eye(4), (2, 4, 1))
    assert float(moe.route(balanced, 1, 16).load_balance) == pytest.approx(1.0, abs=1e-3)
    collapsed = jnp.zeros((2, 16, 4)).at[..., 0].set(10.0)
    assert float(moe.route(collapsed, 1, 16).load_balance) == pytest.approx(4.0, abs=1e-2)


@settings(max_examples=30, deadline=None)
@given(logits=st.lists(st.floats(-5, 5), min_size=4, max_size=4))
def test_aux_loss_is_minimal_at_uniform_when_tokens_agree(logits):
    # Every token with the same router output p: loss = E * max(p) >= 1, = 1 only if uniform.
    row = jnp.asarray(logits, jnp.float32)
    loss = float(moe.route(jnp.tile(row, (1, 8, 1)), 1, 8).load_balance)
    assert loss == pytest.approx(4 * float(jnp.max(jax.nn.softmax(row))), rel=1e-5)
    assert loss >= 1.0 - 1e-6


def _models(num_layers=2):
    config = tiny_config(**{"model.kind": "moe", "model.num_layers": num_layers})
    moe_cfg = config_lib.MoEConfig(num_experts=1, top_k=1, capacity_factor=1.0)
    mesh = make_island_mesh((1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):  # the sharding annotations need a mesh
        model_cfg = model_config(config)  # the vocabulary from the data (256 bytes)
        dense = Transformer(model_cfg, nnx.Rngs(0))
        sparse = moe.MoETransformer(model_cfg, moe_cfg, nnx.Rngs(1))
    dense_params = nnx.to_pure_dict(nnx.state(dense, nnx.Param))
    sparse_params = nnx.to_pure_dict(nnx.state(sparse, nnx.Param))
    return config, dense, sparse, dense_params, sparse_params


def test_one_expert_with_room_for_every_token_equals_the_dense_mlp():
    _, dense, sparse, d, s = _models()
    s["embed"] = d["embed"]
    s["final_norm"] = d["final_norm"]
    for i, block in s["blocks"].items():
        for name in ("attn", "attn_norm", "mlp_norm"):
            block[name] = d["blocks"][i][name]
        for name in ("gate", "up", "down"):
            block["moe"][name] = d["blocks"][i]["mlp"][name]["kernel"][None]
    nnx.update(sparse, s)
    tokens = jax.random.randint(jax.random.key(0), (3, 32), 0, 256)
    logits_sparse, routings = sparse(tokens)
    logits_dense = dense(tokens)
    assert not np.allclose(logits_dense, 0, atol=1e-3)
    np.testing.assert_allclose(logits_sparse, logits_dense, rtol=2e-5, atol=2e-5)
    assert all(float(r.dropped) == 0 for r in routings)
    assert all(float(r.load_balance) == pytest.approx(1.0) for r in routings)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4)])
def test_expert_weights_are_sharded_over_the_model_axis_as_declared(mesh_shape):
    config = tiny_config(
        **{
            "model.kind": "moe",
            "model.num_heads": 4,
            "moe.num_experts": 4,
            "mesh.shape": mesh_shape,
            "num_learners": 1,
        }
    )
    island = Island(config, jax.devices()[:4], mesh_shape=mesh_shape)
    state = island.init(0)
    block = state.params["blocks"][0]["moe"]
    e, d, f = 4, config.model.d_model, config.model.mlp_hidden
    for name, shape in (("gate", (e, d, f)), ("up", (e, d, f)), ("down", (e, f, d))):
        declared = island.param_sharding["blocks"][0]["moe"][name].spec
        assert declared == P(moe.EXPERT_AXIS, None, None)
        assert block[name].shape == shape and block[name].sharding.spec == declared
        # Each device holds E / model-axis experts, whole.
        shard_shape = block[name].addressable_shards[0].data.shape
        assert shard_shape == (e // mesh_shape[1], *shape[1:])
    assert island.param_sharding["blocks"][0]["moe"]["router"]["kernel"].spec == P(None, None)
    # One step keeps the layout and computes what an unsharded island computes.
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.int32)
    single = Island(config, jax.devices()[4:5], mesh_shape=(1, 1))
    _, loss_single = single.step(single.init(0), tokens)
    new_state, loss = island.step(state, tokens)
    assert new_state.params["blocks"][0]["moe"]["gate"].sharding.spec == P("model", None, None)
    assert float(loss) == pytest.approx(float(loss_single), rel=1e-4)


def test_config_checks_experts_split_over_the_model_axis():
    with pytest.raises(config_lib.ConfigError, match="moe.num_experts"):
        tiny_config(**{"model.kind": "moe", "moe.num_experts": 3, "mesh.shape": (1, 2)})
    with pytest.raises(config_lib.ConfigError, match="moe.top_k"):
        tiny_config(**{"model.kind": "moe", "moe.num_experts": 2, "moe.top_k": 3})


def test_rda_on_stacked_experts_leaves_unused_experts_alone_and_does_not_boost_noise():
    rng = np.random.default_rng(0)
    trained = rng.normal(size=(1, 16, 32))  # expert 0: all learners agree
    deltas = []
    for _ in range(4):
        rows = np.concatenate(
            [
                trained + 0.1 * rng.normal(size=(1, 16, 32)),
                np.zeros((1, 16, 32)),  # expert 1: never routed to
                1e-3 * rng.normal(size=(1, 16, 32)),  # expert 2: rare, disagreeing noise
            ]
        )
        deltas.append({"w": jnp.asarray(rows, jnp.float32)})
    weights = [1.0] * 4
    stacked = np.asarray(outer.merge(deltas, weights, "rda")["w"])
    mean = np.asarray(outer.merge(deltas, weights, "mean")["w"])
    assert np.all(stacked[1] == 0)
    ratio_stacked = np.linalg.norm(stacked[2]) / np.linalg.norm(mean[2])
    assert ratio_stacked < 1.1
    # Per-expert tensors would renormalize the rare expert's noise on its own (about sqrt(M)).
    per_expert = outer.merge([{"w": x["w"][2]} for x in deltas], weights, "rda")["w"]
    assert np.linalg.norm(per_expert) / np.linalg.norm(mean[2]) > 1.5
