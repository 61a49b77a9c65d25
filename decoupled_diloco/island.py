"""An island: one learner's device mesh, its shardings, and its jit-compiled inner step.

Several islands can live in one process (tests, Colab, the synchronous modes) on disjoint
device slices, so an island never sets a global mesh: every sharding is bound to its own mesh
and `jax.set_mesh` is only entered inside its methods.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.models.mesh import make_island_mesh
from decoupled_diloco.models.transformer import Params
from decoupled_diloco.optim import make_inner_optimizer
from decoupled_diloco.tasks import Batch, make_task


class InnerState(NamedTuple):
    """What an island's inner step updates: parameters and inner optimizer state."""

    params: Params
    opt_state: optax.OptState


class Island:
    """One learner's mesh, shardings and compiled functions.

    Args:
      config: the experiment config (model, optimizer and batch sizes).
      devices: this island's devices; must be `mesh_shape[0] * mesh_shape[1]` of them.
      mesh_shape: (`data`, `model`) axis sizes; defaults to `config.mesh.shape`.
      batch_size: sequences per inner step; defaults to `config.data.batch_size`.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        devices: Sequence[jax.Device],
        mesh_shape: tuple[int, int] | None = None,
        batch_size: int | None = None,
    ):
        self.config = config
        self.mesh = make_island_mesh(mesh_shape or config.mesh.shape, devices)
        self.batch_size = batch_size or config.data.batch_size
        self.tx = make_inner_optimizer(config)
        # The model, its losses and the batch layout come from the task (`model.kind`).
        self.task = make_task(config)
        with jax.set_mesh(self.mesh):
            abstract_model = nnx.eval_shape(lambda: self.task.build_model(nnx.Rngs(0)))
        self.graphdef, abstract_state = nnx.split(abstract_model, nnx.Param)
        specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
        self.replicated = NamedSharding(self.mesh, P())
        self.param_sharding = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
        )
        self.abstract_params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            nnx.to_pure_dict(abstract_state),
            self.param_sharding,
        )
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        opt_sharding = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract_opt,
            self.param_sharding,
            transform_non_params=lambda _: self.replicated,
        )
        self.state_sharding = InnerState(self.param_sharding, opt_sharding)
        # Shapes, dtypes and shardings of the inner state: the target for checkpoint restores.
        self.abstract_state = InnerState(
            self.abstract_params,
            jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract_opt,
                opt_sharding,
            ),
        )
        self.batch_sharding = NamedSharding(self.mesh, self.task.batch_spec)
        # Held-out batches keep the per-learner batch size in every mode, so on a wide data
        # axis (dp over M learners) they may not split evenly: then each device gets all rows.
        eval_splits = config.data.batch_size % self.mesh.shape["data"] == 0
        self.eval_sharding = self.batch_sharding if eval_splits else self.replicated
        self.trace_count = 0
        # XLA:CPU runs every fake device's share of a program on one shared thread pool, and
        # a collective blocks its thread until all participants arrive. With several steps of
        # a multi-device program queued at once, waiting participants can hold every thread
        # while the last one waits for a thread: a deadlock (seen as a 40 s rendezvous abort).
        # So a multi-device CPU island keeps one step in flight; the host still prepares the
        # next batch while it runs. Otherwise two: enough to hide the host's own work, and a
        # learner's loop stays close to its device, so a merged fragment that arrives is
        # applied within a step or two of the device's progress, not after a whole push
        # interval of steps dispatched ahead from unmerged values.
        one = self.mesh.size > 1 and self.mesh.devices.flat[0].platform == "cpu"
        self._max_in_flight = 1 if one else 2
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._init = jax.jit(self._init_fn, out_shardings=self.state_sharding)
        self._step = jax.jit(
            self._step_fn,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, self.replicated),
            donate_argnums=(0,),
        )
        self._eval = jax.jit(
            self._eval_fn,
            in_shardings=(self.param_sharding, self.eval_sharding),
            out_shardings=self.replicated,
        )

    def _init_fn(self, key: jax.Array) -> InnerState:
        model = self.task.build_model(nnx.Rngs(key))
        params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
        return InnerState(params, self.tx.init(params))

    def _step_fn(self, state: InnerState, batch: Batch) -> tuple[InnerState, jax.Array]:
        self.trace_count += 1  # Runs only while tracing: counts compilations of the step.
        loss, grads = jax.value_and_grad(self.task.train_loss, argnums=1)(
            self.graphdef, state.params, batch
        )
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        return InnerState(optax.apply_updates(state.params, updates), opt_state), loss

    def _eval_fn(self, params: Params, batch: Batch) -> dict[str, jax.Array]:
        return self.task.eval_metrics(self.graphdef, params, batch)

    def init(self, seed: int) -> InnerState:
        """Fresh parameters (same for the same seed on any mesh) and inner optimizer state."""
        with jax.set_mesh(self.mesh):
            return self._init(jax.random.key(seed))

    def put_batch(self, batch: Batch) -> Batch:
        """Moves a host batch onto this island's devices, split over the `data` axis."""
        return jax.device_put(batch, self.batch_sharding)

    def step(self, state: InnerState, batch: Batch) -> tuple[InnerState, jax.Array]:
        """One inner step. Donates `state`; returns the new state and the loss (on device)."""
        if isinstance(batch, np.ndarray | dict):  # host arrays (a dict: an image batch)
            batch = self.put_batch(batch)
        while len(self._in_flight) >= self._max_in_flight:
            self._in_flight.popleft().block_until_ready()
        with jax.set_mesh(self.mesh):
            state, loss = self._step(state, batch)
        self._in_flight.append(loss)
        return state, loss

    def put_params(self, params: Params) -> Params:
        """Places a parameter tree (host or any device) with this island's parameter shardings."""
        return jax.device_put(params, self.param_sharding)

    def evaluate(self, params: Params, batches: Sequence[Batch]) -> float:
        """Mean loss of `params` over fixed host `batches`."""
        return self.evaluate_metrics(params, batches)["loss"]

    def evaluate_metrics(self, params: Params, batches: Sequence[Batch]) -> dict[str, float]:
        """Mean of each evaluation metric (`loss`, and `accuracy` for classification)."""
        # Wait for the step that produced `params` first: on XLA:CPU, two multi-device programs
        # whose collectives interleave can deadlock in the all-reduce rendezvous (seen as an
        # abort after 40 s when a dp eval was dispatched behind an in-flight train step).
        params = jax.block_until_ready(self.put_params(params))
        with jax.set_mesh(self.mesh):
            results = [self._eval(params, jax.device_put(b, self.eval_sharding)) for b in batches]
        results = jax.device_get(results)
        return {k: float(np.mean([r[k] for r in results])) for k in results[0]}
