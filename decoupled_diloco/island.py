"""An island: one learner's device mesh, its shardings, and its jit-compiled inner step.

Several islands can live in one process (tests, Colab, the synchronous modes) on disjoint
device slices, so an island never sets a global mesh: every sharding is bound to its own mesh
and `jax.set_mesh` is only entered inside its methods.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.models.mesh import fsdp_spec, make_island_mesh
from decoupled_diloco.optim import make_inner_optimizer
from decoupled_diloco.tasks import Batch, Task, key_mask, make_task

Params = Any  # the synced tree: a pure dict of the model's parameters (and synced statistics)


class InnerState(NamedTuple):
    """What an island's inner step updates.

    Attributes:
      params: the synced tree (`Task.split`): parameters, and batch statistics under
        `state_policy="average"`; what outer rounds merge.
      opt_state: the inner optimizer's state, over the `nnx.Param` leaves of `params`.
      local: state kept on this learner (RNG state; batch statistics under "local").
    """

    params: Params
    opt_state: optax.OptState
    local: Any = {}


def select(tree: Any, mask: Any, keep: bool) -> Any:
    """The nested dict of `tree`'s leaves whose `mask` leaf is `keep` (empty dicts dropped)."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            part = select(value, mask[key], keep)
            if part:
                out[key] = part
        elif bool(mask[key]) == keep:
            out[key] = value
    return out


def combine(a: Any, b: Any) -> Any:
    """Two nested dicts with disjoint leaves as one (the inverse of the two `select`s)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = combine(out[key], value) if key in out else value
    return out


class Island:
    """One learner's mesh, shardings and compiled functions.

    Args:
      config: the experiment config (model, optimizer and batch sizes).
      devices: this island's devices; must be `mesh_shape[0] * mesh_shape[1]` of them.
      mesh_shape: (`data`, `model`) axis sizes; defaults to `config.mesh.shape`.
      batch_size: sequences per inner step; defaults to `config.data.batch_size`.
      task: the model, loss and metrics (default: `make_task(config)`).
      tx: the inner optimizer (default: the task's, else `config.optim`'s).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        devices: Sequence[jax.Device],
        mesh_shape: tuple[int, int] | None = None,
        batch_size: int | None = None,
        task: Task | None = None,
        tx: optax.GradientTransformation | None = None,
    ):
        self.config = config
        self.mesh = make_island_mesh(mesh_shape or config.mesh.shape, devices)
        self.batch_size = batch_size or config.data.batch_size
        # The model, its losses and the batch layout come from the task.
        self.task = task or make_task(config)
        self.tx = tx or self.task.inner_optimizer or make_inner_optimizer(config)
        with jax.set_mesh(self.mesh):
            abstract_model = nnx.eval_shape(lambda: self.task.build_model(nnx.Rngs(0)))
        self.graphdef, synced_state, local_state = self.task.split_states(abstract_model)
        # Which leaves of the local tree are RNG keys (each learner folds in its own stream).
        self._keys = key_mask(local_state)
        _, abstract_synced, abstract_local = self.task.split(abstract_model)
        specs = nnx.to_pure_dict(nnx.get_partition_spec(synced_state))
        if config.mesh.fsdp:  # parameters (and so their moments) split over `data` too
            data = self.mesh.shape["data"]
            specs = jax.tree.map(
                lambda spec, x: fsdp_spec(spec, x.shape, data),
                specs,
                abstract_synced,
                is_leaf=lambda x: isinstance(x, P),
            )
        self.replicated = NamedSharding(self.mesh, P())
        self.param_sharding = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
        )
        placed = functools.partial(
            jax.tree.map, lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        )
        self.abstract_params = placed(abstract_synced, self.param_sharding)
        # The inner optimizer steps the parameters only (not synced batch statistics).
        self.trainable_mask = self.task.trainable()
        trainable_sharding = select(self.param_sharding, self.trainable_mask, True)
        abstract_opt = jax.eval_shape(
            self.tx.init, select(self.abstract_params, self.trainable_mask, True)
        )
        # Moments take their parameter's sharding. Optimizers that split the tree (Muon's
        # matrices and the rest, `optax.partition`) hold `MaskedNode`s in place of the others.
        masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        opt_sharding = optax.tree_map_params(
            self.tx,
            lambda x, sharding: x if masked(x) else sharding,
            abstract_opt,
            trainable_sharding,
            transform_non_params=lambda _: self.replicated,
            is_leaf=masked,
        )
        local_sharding = jax.tree.map(lambda _: self.replicated, abstract_local)
        self.state_sharding = InnerState(self.param_sharding, opt_sharding, local_sharding)
        # Shapes, dtypes and shardings of the inner state: the target for checkpoint restores.
        self.abstract_state = InnerState(
            self.abstract_params,
            placed(abstract_opt, opt_sharding),
            placed(abstract_local, local_sharding),
        )
        self._fresh_local: Any = None  # the local state of a fresh model (see `evaluate_metrics`)
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
        self.jitted_step = jax.jit(
            self._step_fn,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, self.replicated),
            donate_argnums=(0,),
        )
        self._eval = jax.jit(
            self._eval_fn,
            in_shardings=(self.param_sharding, local_sharding, self.eval_sharding),
            out_shardings=self.replicated,
        )

    def _init_fn(self, key: jax.Array, stream: jax.Array) -> InnerState:
        _, synced, local = self.task.split(self.task.build_model(nnx.Rngs(key)))
        local = jax.tree.map(  # the same parameters everywhere; RNG streams of their own
            lambda x, is_key: (
                jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(x), stream))
                if is_key
                else x
            ),
            local,
            self._keys,
        )
        return InnerState(synced, self.tx.init(select(synced, self.trainable_mask, True)), local)

    def _step_fn(self, state: InnerState, batch: Batch) -> tuple[InnerState, jax.Array]:
        self.trace_count += 1  # Runs only while tracing: counts compilations of the step.
        trainable = select(state.params, self.trainable_mask, True)
        fixed = select(state.params, self.trainable_mask, False)

        def grad_of(fixed: Params, local: Any, batch: Batch) -> tuple:
            def loss_of(trainable: Params) -> tuple[jax.Array, tuple]:
                loss, (synced, local_out, _) = self.task.train_loss(
                    self.graphdef, combine(trainable, fixed), local, batch
                )
                return loss, (synced, local_out)

            return jax.value_and_grad(loss_of, has_aux=True)(trainable)

        count = self.config.optim.microbatches
        if count == 1:
            (loss, (synced, local)), grads = grad_of(fixed, state.local, batch)
        else:  # the batch's rows i, i + k, ... are microbatch i (a slice of every data shard)
            (loss, (synced, local)), grads = self._accumulate(grad_of, fixed, state, batch, count)
        updates, opt_state = self.tx.update(grads, state.opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        # Statistics the forward pass updated (BatchNorm) are kept; gradients never move them.
        params = combine(trainable, select(synced, self.trainable_mask, False))
        return InnerState(params, opt_state, local), loss

    def _accumulate(self, grad_of: Any, fixed: Params, state: InnerState, batch: Batch, k: int):
        """`grad_of` over `k` microbatches in a `lax.scan`: the mean loss and gradient.

        Activations are those of one microbatch. Statistics a forward pass updates (BatchNorm)
        and the local state (RNG keys) go from one microbatch to the next, as over steps.
        """
        sharding = NamedSharding(self.mesh, P(None, self.task.batch_spec[0]))
        micro = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), sharding
            ),
            batch,
        )

        def one(carry: tuple, microbatch: Batch) -> tuple[tuple, None]:
            fixed, local, loss_sum, grad_sum = carry
            (loss, (synced, local)), grads = grad_of(fixed, local, microbatch)
            fixed = select(synced, self.trainable_mask, False)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (fixed, local, loss_sum + loss.astype(jnp.float32), grad_sum), None

        trainable = select(state.params, self.trainable_mask, True)
        zeros = jax.tree.map(jnp.zeros_like, trainable)
        start = (fixed, state.local, jnp.zeros((), jnp.float32), zeros)
        (fixed, local, loss_sum, grad_sum), _ = jax.lax.scan(one, start, micro)
        grads = jax.tree.map(lambda g: g / k, grad_sum)
        return (loss_sum / k, (combine(trainable, fixed), local)), grads

    def _eval_fn(self, params: Params, local: Any, batch: Batch) -> dict[str, jax.Array]:
        return self.task.eval_metrics(self.graphdef, params, local, batch)

    def init(self, seed: int, stream: int = 0) -> InnerState:
        """Fresh parameters (same for the same seed on any mesh) and inner optimizer state.

        `stream` (a learner's id) is folded into the model's RNG state (dropout), which is
        per learner: the parameters do not depend on it.
        """
        with jax.set_mesh(self.mesh):
            return self._init(jax.random.key(seed), np.int32(stream))

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
            state, loss = self.jitted_step(state, batch)
        self._in_flight.append(loss)
        return state, loss

    def put_params(self, params: Params) -> Params:
        """Places a parameter tree (host or any device) with this island's parameter shardings."""
        return jax.device_put(params, self.param_sharding)

    def evaluate(self, params: Params, batches: Sequence[Batch]) -> float:
        """Mean loss of `params` over fixed host `batches`."""
        return self.evaluate_metrics(params, batches)["loss"]

    def evaluate_metrics(
        self, params: Params, batches: Sequence[Batch], local: Any = None
    ) -> dict[str, float]:
        """Mean of each evaluation metric over `batches` (`loss`, and the task's others).

        `local`: the learner-kept state to evaluate with (e.g. a learner's batch statistics
        under `state_policy="local"`); None: a freshly initialised model's.
        """
        if local is None:
            if self._fresh_local is None:
                self._fresh_local = (
                    self.init(self.config.seed).local
                    if jax.tree.leaves(self.abstract_state.local)
                    else {}
                )
            local = self._fresh_local
        # Wait for the step that produced `params` first: on XLA:CPU, two multi-device programs
        # whose collectives interleave can deadlock in the all-reduce rendezvous (seen as an
        # abort after 40 s when a dp eval was dispatched behind an in-flight train step).
        params = jax.block_until_ready(self.put_params(params))
        with jax.set_mesh(self.mesh):
            local = jax.device_put(local, self.state_sharding.local)
            results = [
                self._eval(params, local, jax.device_put(b, self.eval_sharding)) for b in batches
            ]
        results = jax.device_get(results)
        return {k: float(np.mean([r[k] for r in results])) for k in results[0]}
