"""Outer math on parameter pytrees, shared by every mode: outer gradients, merges, outer step.

Sign convention (DiLoCo): the outer gradient is `anchor - local`, so an outer SGD step with
learning rate 1 and no momentum moves the global parameters onto the merged local ones.

All functions are pure and work on any pytree of arrays (numpy or jax); they only use
`jax.numpy`, so they can be jit-compiled on a learner's mesh or run on the syncer's host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any

# Below this norm an outer gradient is treated as zero: it has no direction to average.
_TINY_NORM = 1e-30


def outer_gradient(anchor: PyTree, local: PyTree) -> PyTree:
    """Returns Δ = anchor − local, leaf by leaf."""
    return jax.tree.map(lambda a, x: a - x, anchor, local)


def _normalized(weights: Sequence[float] | jax.Array) -> jax.Array:
    w_M = jnp.asarray(weights, dtype=jnp.float32)
    return w_M / jnp.sum(w_M)


def weighted_mean(deltas: Sequence[PyTree], weights: Sequence[float] | jax.Array) -> PyTree:
    """Σ_m w_m Δ_m / Σ_m w_m, leaf by leaf."""
    w_M = _normalized(weights)
    return jax.tree.map(lambda *xs: _mean_leaf(jnp.stack(xs), w_M), *deltas)


def _mean_leaf(x_M: jax.Array, w_M: jax.Array) -> jax.Array:
    return jnp.tensordot(w_M, x_M, axes=1).astype(x_M.dtype)


def _rda_leaf(x_M: jax.Array, w_M: jax.Array) -> jax.Array:
    flat_MN = x_M.reshape(x_M.shape[0], -1).astype(jnp.float32)
    norm_M = jnp.linalg.norm(flat_MN, axis=1)
    safe_M = jnp.where(norm_M > _TINY_NORM, norm_M, 1.0)
    direction_MN = jnp.where((norm_M > _TINY_NORM)[:, None], flat_MN / safe_M[:, None], 0.0)
    mean_direction_N = w_M @ direction_MN
    mean_direction_norm = jnp.linalg.norm(mean_direction_N)
    unit_N = jnp.where(
        mean_direction_norm > _TINY_NORM,
        mean_direction_N / jnp.where(mean_direction_norm > _TINY_NORM, mean_direction_norm, 1.0),
        0.0,
    )
    return (jnp.dot(w_M, norm_M) * unit_N).reshape(x_M.shape[1:]).astype(x_M.dtype)


def radial_directional_average(
    deltas: Sequence[PyTree], weights: Sequence[float] | jax.Array
) -> PyTree:
    """Radial-directional averaging, per tensor.

    RDA(Δ, w) = (Σ w_m‖Δ_m‖ / Σ w_m) · φ(Σ w_m φ(Δ_m) / Σ w_m), with φ(x) = x / ‖x‖.
    Outer gradients of different learners are nearly orthogonal, so a plain mean shrinks the
    norm by about 1/√M; RDA keeps the merged norm at the mean of the norms.
    """
    w_M = _normalized(weights)
    return jax.tree.map(lambda *xs: _rda_leaf(jnp.stack(xs), w_M), *deltas)


def merge(
    deltas: Sequence[PyTree],
    weights: Sequence[float] | jax.Array,
    method: str,
    is_mean_only: Callable[[tuple[str, ...]], bool] | None = None,
) -> PyTree:
    """Merges M outer gradients into one.

    Args:
      deltas: M pytrees of identical structure.
      weights: M non-negative weights (not necessarily normalised).
      method: `mean` (weighted mean) or `rda` (radial-directional averaging).
      is_mean_only: with `rda`, a predicate on a leaf's key path (tuple of names) selecting the
        tensors merged by the weighted mean instead (embeddings, in Decoupled DiLoCo).

    Returns:
      The merged outer gradient, same structure as each delta.
    """
    if not deltas:
        raise ValueError("merge needs at least one outer gradient")
    if len(weights) != len(deltas):
        raise ValueError(f"{len(deltas)} outer gradients but {len(weights)} weights")
    if method == "mean":
        return weighted_mean(deltas, weights)
    if method != "rda":
        raise ValueError(f"unknown merge method {method!r}; expected 'mean' or 'rda'")
    w_M = _normalized(weights)

    def leaf(path: tuple, *xs: jax.Array) -> jax.Array:
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        stacked = jnp.stack(xs)
        if is_mean_only is not None and is_mean_only(names):
            return _mean_leaf(stacked, w_M)
        return _rda_leaf(stacked, w_M)

    return jax.tree.map_with_path(leaf, *deltas)


class DelayedNesterovState(NamedTuple):
    """Outer steps taken, the momentum, and the sum of the outer gradients since it last moved."""

    count: jax.Array
    momentum: PyTree
    buffer: PyTree


def delayed_nesterov(lr: float, momentum: float, every: int) -> optax.GradientTransformation:
    """Delayed Nesterov (Async Local-SGD, arXiv 2401.09135).

    Each outer step moves the parameters by −lr·g/N without momentum; every N-th step also sets
    m ← β·m + mean(g₁…g_N) and moves by −lr·β·m. Over N steps this is one Nesterov step on the
    averaged outer gradient, so stale asynchronous updates do not compound through the momentum.
    With N = 1 it is exactly SGD with Nesterov momentum.
    """

    def init(params: PyTree) -> DelayedNesterovState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(
        grads: PyTree, state: DelayedNesterovState, params: PyTree = None
    ) -> tuple[PyTree, DelayedNesterovState]:
        del params
        count = state.count + 1
        due = count % every == 0
        buffer = jax.tree.map(lambda b, g: b + g, state.buffer, grads)
        new_m = jax.tree.map(
            lambda m, b: jnp.where(due, momentum * m + b / every, m), state.momentum, buffer
        )
        updates = jax.tree.map(
            lambda g, m: -lr * (g / every + jnp.where(due, momentum * m, 0.0)), grads, new_m
        )
        buffer = jax.tree.map(lambda b: jnp.where(due, jnp.zeros_like(b), b), buffer)
        return updates, DelayedNesterovState(count, new_m, buffer)

    return optax.GradientTransformation(init, update)


def make_outer_optimizer(
    lr: float, momentum: float, nesterov: bool, delayed: int = 0
) -> optax.GradientTransformation:
    """The outer optimizer: SGD with (optionally Nesterov) momentum, as in DiLoCo (0.7 / 0.9).

    With `delayed` = N > 0 it is `delayed_nesterov(lr, momentum, N)` instead.
    """
    if delayed > 0:
        return delayed_nesterov(lr, momentum, delayed)
    return optax.sgd(learning_rate=lr, momentum=momentum or None, nesterov=nesterov)


def outer_step(
    tx: optax.GradientTransformation,
    global_params: PyTree,
    outer_state: optax.OptState,
    merged_delta: PyTree,
) -> tuple[PyTree, optax.OptState]:
    """Applies one outer optimizer step to the global parameters with the merged outer gradient."""
    updates, outer_state = tx.update(merged_delta, outer_state, global_params)
    return optax.apply_updates(global_params, updates), outer_state
