"""Outer math against small numpy re-computations."""

import numpy as np
import optax
import pytest

from decoupled_diloco.core import outer

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _same_data_whatever_ran_before():
    """Each test draws from a fresh RNG, so its numbers do not depend on xdist's test order."""
    global RNG
    RNG = np.random.default_rng(0)


def _tree(scale=1.0):
    return {
        "embed": {"embedding": RNG.normal(size=(6, 4)).astype(np.float32) * scale},
        "w": RNG.normal(size=(4, 3)).astype(np.float32) * scale,
        "b": RNG.normal(size=(3,)).astype(np.float32) * scale,
    }


def _np_rda(xs, w):
    w = np.asarray(w, np.float64) / np.sum(w)
    flat = [np.asarray(x, np.float64).ravel() for x in xs]
    norms = np.array([np.linalg.norm(f) for f in flat])
    direction = sum(wi * f / n for wi, f, n in zip(w, flat, norms, strict=True))
    return (np.dot(w, norms) * direction / np.linalg.norm(direction)).reshape(np.shape(xs[0]))


def test_outer_gradient_sign():
    anchor, local = _tree(), _tree()
    delta = outer.outer_gradient(anchor, local)
    np.testing.assert_allclose(delta["w"], anchor["w"] - local["w"])


def test_nesterov_matches_numpy_over_several_steps():
    lr, mu = 0.7, 0.9
    tx = outer.make_outer_optimizer(lr, mu, nesterov=True)
    params = _tree()
    state = tx.init(params)
    ref_params = {k: np.array(v, np.float64) for k, v in params.items() if k != "embed"}
    ref_m = {k: np.zeros_like(v) for k, v in ref_params.items()}
    for _ in range(4):
        delta = _tree(scale=0.1)
        params, state = outer.outer_step(tx, params, state, delta)
        for k in ref_params:
            ref_m[k] = mu * ref_m[k] + delta[k]
            ref_params[k] = ref_params[k] - lr * (delta[k] + mu * ref_m[k])
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-5, atol=1e-6)


def test_plain_sgd_lr1_moves_onto_merged_locals():
    tx = outer.make_outer_optimizer(1.0, 0.0, nesterov=False)
    anchor, locals_ = _tree(), [_tree(), _tree()]
    deltas = [outer.outer_gradient(anchor, x) for x in locals_]
    merged = outer.merge(deltas, [1.0, 1.0], "mean")
    new, _ = outer.outer_step(tx, anchor, tx.init(anchor), merged)
    np.testing.assert_allclose(
        new["w"], (locals_[0]["w"] + locals_[1]["w"]) / 2, rtol=1e-5, atol=1e-6
    )


def test_weighted_mean_matches_numpy():
    deltas, w = [_tree(), _tree(), _tree()], [1.0, 2.0, 5.0]
    merged = outer.merge(deltas, w, "mean")
    expected = sum(wi * d["w"] for wi, d in zip(w, deltas, strict=True)) / sum(w)
    np.testing.assert_allclose(merged["w"], expected, rtol=1e-5, atol=1e-6)


def test_rda_matches_numpy_and_keeps_embeddings_on_the_mean():
    deltas, w = [_tree(), _tree(), _tree()], [3.0, 1.0, 2.0]
    mask = outer.mean_only_mask(deltas[0], lambda name: name.startswith("embed/"))
    assert mask == {"embed": {"embedding": True}, "w": False, "b": False}
    merged = outer.merge(deltas, w, "rda", mask)
    for key in ("w", "b"):
        np.testing.assert_allclose(
            merged[key], _np_rda([d[key] for d in deltas], w), rtol=1e-5, atol=1e-6
        )
    mean = outer.weighted_mean(deltas, w)
    np.testing.assert_allclose(merged["embed"]["embedding"], mean["embed"]["embedding"], rtol=1e-6)
    assert not np.allclose(merged["w"], mean["w"])


def test_rda_of_parallel_deltas_equals_weighted_mean():
    direction = RNG.normal(size=(5, 7)).astype(np.float32)
    deltas = [{"x": direction * s} for s in (0.5, 2.0, 3.0)]
    w = [1.0, 4.0, 2.0]
    rda = outer.radial_directional_average(deltas, w)
    mean = outer.weighted_mean(deltas, w)
    np.testing.assert_allclose(rda["x"], mean["x"], rtol=1e-5, atol=1e-6)


def test_rda_norm_is_weighted_mean_of_norms():
    deltas, w = [_tree(), _tree(), _tree(), _tree()], [1.0, 1.0, 3.0, 0.5]
    rda = outer.radial_directional_average(deltas, w)
    norms = np.array([np.linalg.norm(d["w"]) for d in deltas])
    expected = np.dot(w, norms) / np.sum(w)
    assert np.linalg.norm(rda["w"]) == pytest.approx(expected, rel=1e-5)
    # The plain mean of near-orthogonal deltas is shorter: what RDA exists to fix.
    assert np.linalg.norm(outer.weighted_mean(deltas, w)["w"]) < expected


def test_rda_handles_zero_deltas():
    zero = {"x": np.zeros((3,), np.float32)}
    merged = outer.radial_directional_average([zero, zero], [1.0, 1.0])
    np.testing.assert_array_equal(merged["x"], np.zeros(3))
    assert np.all(np.isfinite(merged["x"]))


def test_merge_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown merge method"):
        outer.merge([_tree()], [1.0], "median")
    with pytest.raises(ValueError, match="weights"):
        outer.merge([_tree(), _tree()], [1.0], "mean")
    with pytest.raises(ValueError, match="at least one"):
        outer.merge([], [], "mean")


def test_outer_optimizer_is_an_optax_transformation():
    assert isinstance(outer.make_outer_optimizer(0.7, 0.9, True), optax.GradientTransformation)


def test_delayed_nesterov_with_n1_is_nesterov_and_over_n_steps_is_one_step_on_the_mean():
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((3, 4)).astype(np.float32)}
    grads = [{"w": rng.standard_normal((3, 4)).astype(np.float32)} for _ in range(6)]

    def run(tx, gs):
        p, state = params, tx.init(params)
        for g in gs:
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return np.asarray(p["w"])

    lr, mu = 0.7, 0.9
    np.testing.assert_allclose(
        run(outer.make_outer_optimizer(lr, mu, True, delayed=1), grads),
        run(outer.make_outer_optimizer(lr, mu, True), grads),
        rtol=1e-5,
        atol=1e-6,
    )
    # N = 3: after 3 and 6 steps, numpy Nesterov on the means of each group of 3.
    got = run(outer.make_outer_optimizer(lr, mu, True, delayed=3), grads)
    w, m = params["w"].astype(np.float64), np.zeros((3, 4))
    for group in (grads[:3], grads[3:]):
        mean = np.mean([g["w"] for g in group], axis=0)
        m = mu * m + mean
        w = w - lr * (mean + mu * m)
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_merge_back_overwrites_keeps_overlap_and_residual_and_mixes_by_alpha():
    merged, local = np.full(3, 2.0, np.float32), np.array([1.0, 4.0, -2.0], np.float32)
    at_push, unsent = np.array([0.5, 3.0, -2.5], np.float32), np.array([0.1, 0.0, 1.0], np.float32)
    np.testing.assert_array_equal(outer.merge_back(merged, local), merged)
    # keep_overlap: Θ + (θ − θ_push); keep_unsent: − residual; alpha: α·θ + (1 − α)·(...)
    np.testing.assert_allclose(outer.merge_back(merged, local, at_push=at_push), [2.5, 3.0, 2.5])
    np.testing.assert_allclose(outer.merge_back(merged, local, unsent=unsent), [1.9, 2.0, 1.0])
    np.testing.assert_allclose(outer.merge_back(merged, local, alpha=0.25), [1.75, 2.5, 1.0])
    both = outer.merge_back(merged, local, at_push, unsent, alpha=0.5)
    np.testing.assert_allclose(both, 0.5 * local + 0.5 * np.array([2.4, 3.0, 1.5]), rtol=1e-6)


def test_token_weight_is_tokens_squared_over_steps():
    assert outer.token_weight(1024, 4) == 1024 * 256
    assert outer.token_weight(512, 1) == 512 * 512
    assert outer.token_weight(0, 0) == 0.0
