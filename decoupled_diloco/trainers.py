"""The synchronous modes in one process: data-parallel (`dp`) and DiLoCo (`diloco`).

Both consume the same per-learner data shards, so they differ only in who averages what, and
when. `dp` is one island spanning all learners' devices: its batch is the concatenation of
the M learners' batches, so the gradient is averaged over all of them every step (the same
total batch as M islands). `diloco` runs M islands on disjoint device slices for H inner
steps, then merges their outer gradients and applies the outer step; every island restarts
from the new global parameters.
"""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import grain
import jax
import numpy as np
import optax

from decoupled_diloco.checkpointing import IslandCheckpointer
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import outer
from decoupled_diloco.island import Island
from decoupled_diloco.tasks import Task, make_task

PyTree = Any
Params = Any


class DiLoCoOuter:
    """The synchronous outer round on M parameter trees: what `diloco` mode does at each sync.

    For a user's own loop over M models in one process (optax-style, pure):

        outer = dd.DiLoCoOuter(config, task)
        outer_state = outer.init(global_params)
        ...  # H inner steps of each of the M copies
        global_params, outer_state = outer.update(global_params, outer_state, [p_1, ..., p_M])

    The merge (`outer.merge`, token-weighted), the outer optimizer (`config.outer`) and the
    task's rules (mean-only tensors; averaged batch statistics) are the syncer's.

    Args:
      config: the experiment (`outer` settings, `inner_steps`, `data.batch_size`).
      task: whose merge rules and token counts apply (default: `make_task(config)`).
    """

    def __init__(self, config: ExperimentConfig, task: Task | None = None):
        self.config, self.task = config, task or make_task(config)
        o = config.outer
        self.tx = outer.make_outer_optimizer(o.lr, o.momentum, o.nesterov, o.delayed_nesterov)
        self._round: Any = None

    def init(self, global_params: Params) -> optax.OptState:
        """The outer optimizer's state for `global_params` (host arrays)."""
        return jax.device_get(self.tx.init(jax.device_get(global_params)))

    def update(
        self,
        global_params: Params,
        outer_state: optax.OptState,
        local_params: Sequence[Params],
        tokens: Sequence[int] | None = None,
        steps: Sequence[int] | None = None,
    ) -> tuple[Params, optax.OptState]:
        """Merges the M trees' outer gradients and takes the outer step (host arrays out).

        Args:
          global_params: Θ, the global parameters the M copies started the round from.
          outer_state: from `init` or the previous `update`.
          local_params: θ_1..θ_M after their inner steps.
          tokens: what each copy trained on this round (default: H steps of the task's).
          steps: inner steps each took (default: H).
        """
        m = len(local_params)
        steps = list(steps) if steps is not None else [self.config.inner_steps] * m
        if tokens is None:
            per_step = self.task.tokens_per_step(self.config.data.batch_size)
            tokens = [s * per_step for s in steps]
        weights = [outer.token_weight(t, s) for t, s in zip(tokens, steps, strict=True)]
        if self._round is None:
            mean_only = outer.mean_only_mask(global_params, self.task.is_mean_only)
            averaged = outer.mean_only_mask(global_params, self.task.is_averaged)
            self._round = jax.jit(
                functools.partial(
                    _outer_round, self.tx, self.config.outer.merge, mean_only, averaged
                )
            )
        local = [jax.device_get(p) for p in local_params]
        new_global, new_outer = self._round(global_params, outer_state, local, weights)
        return jax.device_get(new_global), jax.device_get(new_outer)


def slow_down(
    config: ExperimentConfig,
    learners: int | Sequence[int],
    t_start: float,
    loss: jax.Array,
    controls: Sequence[Any] = (),
) -> None:
    """Stretches a step to `slowdown` times its length if one of `learners` is slow.

    A stand-in for older hardware: the step is finished, then the learner sleeps
    (slowdown - 1) times as long as the step took. A learner is slow if it is
    `config.slow_learner`, or while a fault schedule slows it (`controls[i]`, a
    `chaos.faults.Controls` or None per learner).
    """
    ids = [learners] if isinstance(learners, int) else list(learners)
    factor = max(
        [config.slowdown if i == config.slow_learner else 1.0 for i in ids]
        + [controls[i].slowdown() for i in ids if i < len(controls) and controls[i] is not None]
    )
    if factor > 1:
        loss.block_until_ready()
        time.sleep((factor - 1) * (time.perf_counter() - t_start))


class DataParallelTrainer:
    """Synchronous data parallelism over the M learners' devices and data shards.

    Args:
      config: the experiment.
      devices: every learner's devices, learner i's slice after learner i − 1's.
      iterators: each learner's data shard.
      checkpoint_dir: where checkpoints go (None: no checkpoints).
      controls: per learner, live fault controls (`chaos.faults.Controls`) or None.
      task: the model, loss and metrics (default: `make_task(config)`).
      tx: the inner optimizer (default: the task's, else `config.optim`'s).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        devices: Sequence[jax.Device],
        iterators: Sequence[grain.DatasetIterator],
        checkpoint_dir: pathlib.Path | None,
        controls: Sequence[Any] = (),
        task: Task | None = None,
        tx: optax.GradientTransformation | None = None,
    ):
        m, (data_axis, model_axis) = config.num_learners, config.mesh.shape
        self.config, self.controls = config, list(controls)
        self.iterators = list(iterators)
        self.island = Island(
            config,
            devices[: m * config.devices_per_learner],
            mesh_shape=(m * data_axis, model_axis),
            batch_size=m * config.data.batch_size,
            task=task,
            tx=tx,
        )
        self.islands = [self.island]
        self.state = self.island.init(config.seed)
        self.checkpointers = (
            [IslandCheckpointer(checkpoint_dir / "dp", config.checkpoint.max_to_keep)]
            if checkpoint_dir
            else []
        )
        self.syncs = 0

    def step(self, step: int) -> tuple[list[jax.Array], bool]:
        """One synchronous step; returns the loss (as a one-element list) and `synced=True`."""
        parts = [next(it) for it in self.iterators]
        # Leaf by leaf: a token array, or each array of an image batch dict.
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
        t_start = time.perf_counter()
        self.state, loss = self.island.step(self.state, batch)
        # Every learner's devices are in this one step: a slow learner slows all of them.
        slow_down(self.config, range(self.config.num_learners), t_start, loss, self.controls)
        return [loss], True

    def global_params(self) -> Params:
        """The model being trained."""
        return self.state.params

    def eval_local(self) -> PyTree:
        """The learner-kept state the global model is evaluated with."""
        return self.state.local

    def save(self, step: int) -> None:
        """Starts an asynchronous checkpoint of the model, optimizer and data positions."""
        meta = {"step": step, "data": [it.get_state() for it in self.iterators]}
        self.checkpointers[0].save(step, {"inner": self.state}, meta)

    def restore(self) -> int:
        """Restores the newest readable checkpoint; returns its step (0 if none)."""
        found = self.checkpointers[0].restore_latest({"inner": self.island.abstract_state})
        step = found[0] if found else 0
        self.checkpointers[0].discard_after(step)
        if found is None:
            return 0
        _, state, meta = found
        self.state = state["inner"]
        for it, it_state in zip(self.iterators, meta["data"], strict=True):
            it.set_state(it_state)
        return step


class DiLoCoTrainer:
    """Synchronous DiLoCo: M islands, an outer step every H inner steps (args: as `dp`'s).

    Learner-kept state (`Task.state_policy="local"`) stays with each island; the global model
    is evaluated with island 0's.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        devices: Sequence[jax.Device],
        iterators: Sequence[grain.DatasetIterator],
        checkpoint_dir: pathlib.Path | None,
        controls: Sequence[Any] = (),
        task: Task | None = None,
        tx: optax.GradientTransformation | None = None,
    ):
        self.config, self.controls = config, list(controls)
        self.iterators = list(iterators)
        per = config.devices_per_learner
        task = task or make_task(config)
        self.islands = [
            Island(config, devices[i * per : (i + 1) * per], task=task, tx=tx)
            for i in range(config.num_learners)
        ]
        # Every island starts from the same parameters (same seed, any mesh).
        self.states = [island.init(config.seed, i) for i, island in enumerate(self.islands)]
        self.anchor = jax.device_get(self.states[0].params)
        # The syncer's outer round, on the whole model (`core.outer.outer_round`).
        self.outer = DiLoCoOuter(config, task)
        self.outer_state = self.outer.init(self.anchor)
        self.checkpointers = (
            [
                IslandCheckpointer(checkpoint_dir / f"learner_{i}", config.checkpoint.max_to_keep)
                for i in range(config.num_learners)
            ]
            if checkpoint_dir
            else []
        )
        self.syncs = 0

    def step(self, step: int) -> tuple[list[jax.Array], bool]:
        """One inner step on every island, then the outer step when a round ends.

        Returns:
          The islands' losses (on device) and whether an outer step ran.
        """
        losses = []
        for i, island in enumerate(self.islands):
            t_start = time.perf_counter()
            self.states[i], loss = island.step(self.states[i], next(self.iterators[i]))
            slow_down(self.config, i, t_start, loss, self.controls)
            losses.append(loss)
        round_done = step % self.config.inner_steps == 0 or step == self.config.train_steps
        if round_done:
            self.sync()
        return losses, round_done

    def sync(self) -> None:
        """Merges the islands' outer gradients, applies the outer step, broadcasts the result."""
        # Token weights, as the syncer's: every island trained the same steps and tokens.
        self.anchor, self.outer_state = self.outer.update(
            self.anchor, self.outer_state, [state.params for state in self.states]
        )
        for i, island in enumerate(self.islands):
            self.states[i] = self.states[i]._replace(params=island.put_params(self.anchor))
        self.syncs += 1

    def global_params(self) -> Params:
        """The outer (global) parameters, as of the last outer step."""
        return self.anchor

    def eval_local(self) -> PyTree:
        """The learner-kept state the global model is evaluated with (island 0's)."""
        return self.states[0].local

    def _checkpoint_tree(self, i: int) -> dict[str, PyTree]:
        return {"inner": self.states[i], "anchor": self.anchor, "outer": self.outer_state}

    def _abstract_tree(self, i: int) -> dict[str, PyTree]:
        island = self.islands[i]
        with_sharding = functools.partial(
            jax.tree.map,
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), np.asarray(x).dtype, sharding=island.replicated
            ),
        )
        return {
            "inner": island.abstract_state,
            "anchor": with_sharding(self.anchor),
            "outer": with_sharding(self.outer_state),
        }

    def save(self, step: int) -> None:
        """Checkpoints every island (state, anchor, outer state, data position) at `step`."""
        for i, checkpointer in enumerate(self.checkpointers):
            meta = {"step": step, "data": [self.iterators[i].get_state()], "syncs": self.syncs}
            checkpointer.save(step, self._checkpoint_tree(i), meta)

    def restore(self) -> int:
        """Restores every island from the newest step that all of them can read (0 if none)."""
        common = set.intersection(*(set(c.all_steps()) for c in self.checkpointers))
        while common:
            step = max(common)
            restored = [
                c.restore_latest(self._abstract_tree(i), allowed=lambda s, step=step: s == step)
                for i, c in enumerate(self.checkpointers)
            ]
            if all(r is not None for r in restored):
                for i, (_, tree, meta) in enumerate(restored):
                    self.states[i] = tree["inner"]
                    self.iterators[i].set_state(meta["data"][0])
                self.anchor = jax.device_get(restored[0][1]["anchor"])
                self.outer_state = jax.device_get(restored[0][1]["outer"])
                self.syncs = restored[0][2].get("syncs", 0)
                self._discard_after(step)
                return step
            common.discard(step)
        self._discard_after(0)
        return 0

    def _discard_after(self, step: int) -> None:
        for checkpointer in self.checkpointers:
            checkpointer.discard_after(step)


def _outer_round(
    tx: Any,
    method: str,
    mean_only: PyTree,
    averaged: PyTree,
    anchor: Params,
    outer_state: PyTree,
    local: list[Params],
    weights: list,
) -> tuple[Params, PyTree]:
    deltas = [outer.outer_gradient(anchor, params) for params in local]
    return outer.outer_round(
        tx, method, mean_only, anchor, outer_state, deltas, weights, averaged=averaged
    )
