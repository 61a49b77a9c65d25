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

from decoupled_diloco.checkpointing import IslandCheckpointer
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import outer
from decoupled_diloco.island import InnerState, Island
from decoupled_diloco.models.transformer import Params

PyTree = Any


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
    """

    def __init__(
        self,
        config: ExperimentConfig,
        devices: Sequence[jax.Device],
        iterators: Sequence[grain.DatasetIterator],
        checkpoint_dir: pathlib.Path | None,
        controls: Sequence[Any] = (),
    ):
        m, (data_axis, model_axis) = config.num_learners, config.mesh.shape
        self.config, self.controls = config, list(controls)
        self.iterators = list(iterators)
        self.island = Island(
            config,
            devices[: m * config.devices_per_learner],
            mesh_shape=(m * data_axis, model_axis),
            batch_size=m * config.data.batch_size,
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
    """Synchronous DiLoCo: M islands, an outer step every H inner steps (args: as `dp`'s)."""

    def __init__(
        self,
        config: ExperimentConfig,
        devices: Sequence[jax.Device],
        iterators: Sequence[grain.DatasetIterator],
        checkpoint_dir: pathlib.Path | None,
        controls: Sequence[Any] = (),
    ):
        self.config, self.controls = config, list(controls)
        self.iterators = list(iterators)
        per = config.devices_per_learner
        self.islands = [
            Island(config, devices[i * per : (i + 1) * per]) for i in range(config.num_learners)
        ]
        self.outer_tx = outer.make_outer_optimizer(
            config.outer.lr,
            config.outer.momentum,
            config.outer.nesterov,
            config.outer.delayed_nesterov,
        )
        # Every island starts from the same parameters (same seed, any mesh).
        self.states = [island.init(config.seed) for island in self.islands]
        self.anchor = jax.device_get(self.states[0].params)
        self.outer_state = jax.device_get(self.outer_tx.init(self.anchor))
        # The syncer's outer round, on the whole model (`core.outer.outer_round`).
        mean_only = outer.mean_only_mask(self.anchor, self.islands[0].task.is_mean_only)
        self._outer_round = jax.jit(
            functools.partial(_outer_round, self.outer_tx, config.outer.merge, mean_only)
        )
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
        local = [jax.device_get(state.params) for state in self.states]
        # Token weights, as the syncer's: every island trained the same steps and tokens.
        steps = self.config.inner_steps
        weights = [outer.token_weight(steps * self.config.tokens_per_step, steps)] * len(local)
        new_global, new_outer = self._outer_round(self.anchor, self.outer_state, local, weights)
        self.anchor = jax.device_get(new_global)
        self.outer_state = jax.device_get(new_outer)
        for i, island in enumerate(self.islands):
            self.states[i] = InnerState(island.put_params(self.anchor), self.states[i].opt_state)
        self.syncs += 1

    def global_params(self) -> Params:
        """The outer (global) parameters, as of the last outer step."""
        return self.anchor

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
    anchor: Params,
    outer_state: PyTree,
    local: list[Params],
    weights: list,
) -> tuple[Params, PyTree]:
    deltas = [outer.outer_gradient(anchor, params) for params in local]
    return outer.outer_round(tx, method, mean_only, anchor, outer_state, deltas, weights)
