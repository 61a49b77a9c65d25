"""Outer math on parameter pytrees, shared by every mode: outer gradients, merges, outer step.

One outer gradient's path through these functions, in every mode:
  learner: `outer_gradient` (Δ = anchor − θ after H inner steps; encoded by `compression`)
  merge:   `outer_round` = `merge` (token weights from `token_weight`, RDA or mean per tensor)
           + `outer_step` (Nesterov); the `diloco` trainer and the syncer call the same one
  back:    `merge_back` puts the merged global values into a learner's live parameters.

Sign convention (DiLoCo): the outer gradient is `anchor - local`, so an outer SGD step with
learning rate 1 and no momentum moves the global parameters onto the merged local ones.

All functions are pure and work on any pytree of arrays (numpy or jax); they only use
`jax.numpy`, so they can be jit-compiled on a learner's mesh or run on the syncer's host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decoupled_diloco.core.fragments import path_name

PyTree = Any

# Below this norm an outer gradient is treated as zero: it has no direction to average.
_TINY_NORM = 1e-30


def outer_gradient(anchor: PyTree, local: PyTree) -> PyTree:
    """Returns Δ = anchor − local, leaf by leaf (numpy in, numpy out; jax in, jax out)."""
    return jax.tree.map(lambda a, x: a - x, anchor, local)


class Difference:
    """One tensor of Δ = anchor − local on the host, computed a piece at a time as it is read.

    A learner streams its outer gradient to the syncer a chunk at a time (`comm.wire`): built
    from this, a fragment's Δ never exists whole (a fragment-sized buffer less per push).

    Args:
      anchor: the anchor tensor (numpy; never written).
      local: θ, of the same shape and dtype (numpy; never written).
    """

    def __init__(self, anchor: np.ndarray, local: np.ndarray):
        if anchor.shape != local.shape or anchor.dtype != local.dtype:
            raise ValueError(
                f"anchor {anchor.shape} {anchor.dtype} and local {local.shape} {local.dtype} differ"
            )
        self.shape, self.dtype = anchor.shape, anchor.dtype
        self.nbytes = anchor.nbytes
        self._a, self._x = anchor.reshape(-1), local.reshape(-1)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole difference (for a caller that wants it at once)."""
        whole = (self._a - self._x).reshape(self.shape)
        return whole if dtype is None else whole.astype(dtype)

    def le_bytes(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the difference's little-endian encoding, computed now."""
        size = self.dtype.itemsize
        first, last = start // size, -(-stop // size)
        piece = self._a[first:last] - self._x[first:last]
        raw = piece.astype(piece.dtype.newbyteorder("<"), copy=False).tobytes()
        return raw[start - first * size : stop - first * size]


def token_weight(tokens: int, steps: int) -> float:
    """Token weight w = tokens · (tokens / steps) of one outer gradient: quantity times quality.

    Decoupled DiLoCo, Sec. 3.2: a learner that trained more tokens counts more, and one that
    did so in fewer steps (larger batches) more again.
    """
    return float(tokens) * float(tokens) / max(float(steps), 1.0)


def mean_only_mask(tree: PyTree, is_mean_only: Callable[[str], bool]) -> PyTree:
    """A pytree of bools, like `tree`: which tensors `merge` averages by the plain mean.

    Args:
      tree: parameters (or their shapes); dict keys name the tensors.
      is_mean_only: a predicate on a tensor's `/`-joined path (`fragments.path_name`), e.g. the
        task's choice of embedding tables.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: bool(is_mean_only(path_name(path))), tree
    )


def bounded_shares(weights: Sequence[float], cap: float) -> list[float]:
    """Normalised weights (summing to 1) in which no entry exceeds `cap`, where that is possible.

    An entry above the cap is cut to it and the rest is shared among the others in proportion
    to their weights, repeated until none exceeds it (water-filling), so one outer gradient with
    an outsized token count cannot stand in for the whole merge. With k positive entries and
    k·cap ≤ 1 (no way to respect the cap) they share equally; zero (or non-finite) weights get
    a zero share. Computed in float64 on the host: no weight
    can overflow. All-zero weights give all-zero shares (a merge that moves nothing).
    """
    return shares_and_factor(weights, cap)[0]


def shares_and_factor(weights: Sequence[float], cap: float) -> tuple[list[float], float]:
    """`bounded_shares`, and the factor c with share = c · weight for every entry not capped.

    c is 0 when no entry is proportional to its weight (all capped, or equal shares of unequal
    weights); the syncer folds weights as pushes arrive and rescales its sums by c when the
    round closes.
    """
    w = [float(x) if math.isfinite(float(x)) and float(x) > 0 else 0.0 for x in weights]
    total = math.fsum(w)
    if not total > 0:
        return [0.0] * len(w), 0.0
    positive = [i for i, x in enumerate(w) if x > 0]  # zero weights keep a zero share
    if cap * len(positive) <= 1.0:
        equal = [1.0 / len(positive) if x > 0 else 0.0 for x in w]
        # Equal weights (a lone push, say) are still proportional to their shares.
        same = all(w[i] == w[positive[0]] for i in positive)
        return equal, (1.0 / (len(positive) * w[positive[0]]) if same else 0.0)
    shares, fixed, factor = [x / total for x in w], set(), 1.0 / total
    while True:
        over = {i for i, s in enumerate(shares) if s > cap and i not in fixed}
        if not over:
            return shares, factor
        fixed |= over
        free = [i for i in positive if i not in fixed]
        rest = 1.0 - cap * len(fixed)
        free_total = math.fsum(w[i] for i in free)
        factor = rest / free_total
        for i in fixed:
            shares[i] = cap
        for i in free:
            shares[i] = factor * w[i]


def _normalized(weights: Sequence[float] | jax.Array) -> jax.Array:
    w_M = jnp.asarray(weights, dtype=jnp.float32)
    total = jnp.sum(w_M)
    return jnp.where(total > 0, w_M / jnp.where(total > 0, total, 1.0), 0.0)  # never 0/0


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
    mean_only: PyTree | None = None,
) -> PyTree:
    """Merges M outer gradients into one.

    Args:
      deltas: M pytrees of identical structure.
      weights: M non-negative weights (not necessarily normalised).
      method: `mean` (weighted mean) or `rda` (radial-directional averaging).
      mean_only: with `rda`, a pytree of bools like each delta (`mean_only_mask`): the tensors
        merged by the weighted mean instead (embeddings, in Decoupled DiLoCo). None: none.

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
    if mean_only is None:
        mean_only = jax.tree.map(lambda _: False, deltas[0])

    def leaf(plain: bool, *xs: jax.Array) -> jax.Array:
        return (_mean_leaf if plain else _rda_leaf)(jnp.stack(xs), w_M)

    return jax.tree.map(leaf, mean_only, *deltas)


def outer_round(
    tx: optax.GradientTransformation,
    method: str,
    mean_only: PyTree | None,
    global_params: PyTree,
    outer_state: optax.OptState,
    deltas: Sequence[PyTree],
    weights: Sequence[float] | jax.Array,
    scale: float | jax.Array = 1.0,
    averaged: PyTree | None = None,
) -> tuple[PyTree, optax.OptState]:
    """One outer round: merge M outer gradients, scale the result, take the outer step.

    The synchronous `diloco` trainer and the syncer (per fragment) both call this, so the
    merge rules are the same in every mode. Jit it with the first three arguments bound.

    Args:
      tx: the outer optimizer (`make_outer_optimizer`).
      method: `mean` or `rda` (see `merge`).
      mean_only: which tensors `rda` merges by the plain mean (`mean_only_mask`), or None.
      global_params: the global parameters Θ the outer gradients are anchored at.
      outer_state: `tx`'s state.
      deltas: M outer gradients Δ_m = Θ − θ_m (`outer_gradient`).
      weights: their weights (`token_weight`); zero-weight entries leave the merge unchanged.
      scale: multiplies the merged outer gradient (the syncer's `partial_merge="share"`: the
        merge's share of the learners), else 1.
      averaged: a pytree of bools (static) like `global_params`: tensors that are state, not
        parameters (batch statistics): Θ − scale · mean(Δ), the weighted mean of the pushed
        values (with `scale`, a lone push's share of it), with no RDA and no outer optimizer.
        None: none.

    Returns:
      The new global parameters and outer optimizer state.
    """
    if averaged is not None:
        mean_only = jax.tree.map(
            lambda a, m: bool(a) or bool(m),
            averaged,
            mean_only if mean_only is not None else averaged,
        )
    merged = jax.tree.map(lambda x: x * scale, merge(deltas, weights, method, mean_only))
    new_params, outer_state = outer_step(tx, global_params, outer_state, merged)
    if averaged is not None:  # state: no outer optimizer
        new_params = jax.tree.map(
            lambda a, stepped, g, d: g - d if a else stepped,
            averaged,
            new_params,
            global_params,
            merged,
        )
    return new_params, outer_state


def merge_back(
    merged: jax.Array,
    local: jax.Array,
    at_push: jax.Array | None = None,
    unsent: jax.Array | None = None,
    alpha: float = 0.0,
) -> jax.Array:
    """A learner's new value of one tensor once the merged global value of its fragment arrives.

    Args:
      merged: the merged global value Θ (on the learner's devices).
      local: the learner's live value θ.
      at_push: with `keep_overlap`, θ when the push this merge answers left: the local
        progress since then, θ − θ_push, is kept on top of Θ.
      unsent: with `keep_unsent`, the error-feedback residual in outer-gradient units
        (anchor − θ) that compression held back: Θ − residual keeps it in the parameters.
      alpha: 0 overwrites; else α·θ + (1 − α)·Θ' (Θ' after the two terms above).
    """
    value = merged
    if at_push is not None:
        value = value + (local - at_push)
    if unsent is not None:
        value = value - unsent
    return value if alpha == 0 else alpha * local + (1 - alpha) * value


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
