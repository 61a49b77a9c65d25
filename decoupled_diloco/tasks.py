"""Tasks: which model trains, with which loss, metrics, data and inner optimizer.

The island, the trainers, the learner, the syncer and the launcher are task-agnostic: they ask
the task for the model, its loss and metrics, the batch layout, what one "token" is, and which
of the model's state is synced. A task is either one of the built-in models (`config.model.kind`:
"transformer", "moe", "vit") or the user's own, from any `nnx.Module`:

    task = dd.Task.from_nnx(build_model=lambda rngs: CNN(rngs=rngs), loss_fn=my_loss)

Across processes a user's task is named by an import path, `config.task = "mypkg.tasks:make_task"`
(`make_task(config) -> Task`), that every process (learner, syncer, evaluator) imports.

State that is not a parameter (`nnx.BatchStat`, `nnx.RngState`, any other `nnx.Variable`) follows
the task's `state_policy`: "average" (the default) syncs the batch statistics with the parameters
and replaces them at every outer step by the token-weighted mean of the learners' values (no outer
optimizer, no RDA); "local" keeps them on each learner. RNG state is always kept per learner
(each learner draws its own dropout masks). See docs/byom.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from decoupled_diloco.config import DATASETS, ConfigError, ExperimentConfig, ModelConfig
from decoupled_diloco.core import fragments
from decoupled_diloco.models.mesh import make_island_mesh

Batch = Any  # an array with a leading batch axis, or a dict of them
PyTree = Any
STATE_POLICIES = ("average", "local")
_BATCH_SPEC = P("data")  # the leading axis of every batch array over the mesh's data axis
# (graphdef, synced, local, batch) -> (loss, (synced after the forward pass, local after, aux))
LossFn = Callable[[nnx.GraphDef, PyTree, PyTree, Batch], tuple[jax.Array, tuple]]
# (graphdef, synced, local, batch) -> {"loss": ..., more scalars}
MetricsFn = Callable[[nnx.GraphDef, PyTree, PyTree, Batch], dict[str, jax.Array]]


def _no_tensor(name: str) -> bool:
    del name
    return False


@dataclasses.dataclass(frozen=True)
class Task:
    """What an island needs to know about the model, its loss and its data.

    Build one with `Task.from_nnx` (any model) or `make_task` (a config's). The arrays an island
    holds are two pure-dict trees of the model's `nnx.Variable`s: `synced` (the parameters, plus
    the batch statistics under `state_policy="average"`), which the outer rounds merge, and
    `local` (RNG state, and batch statistics under "local"), which stays on the learner.

    Attributes:
      name: the task's name, part of its identity ("language_modeling", "classification",
        or the user's).
      build_model: builds the NNX module from an `nnx.Rngs`.
      train_loss: (graphdef, synced, local, batch) -> (loss, (synced', local', aux dict)),
        in training mode; differentiated with respect to the `nnx.Param` leaves of `synced`.
      eval_metrics: (graphdef, synced, local, batch) -> dict of scalars with at least `loss`, in
        evaluation mode.
      batch_spec: partition spec of every batch array over the island mesh (`data` first).
      is_mean_only: a predicate on a tensor's `/`-joined key path: the tensors RDA merges by
        the plain weighted mean (the built-in models: the embedding tables).
      state_policy: "average" or "local" (see the module doc).
      tokens_per_example: what one batch row counts as (the LM: `seq_len` tokens; else 1).
      token_unit: what is counted ("tokens", "examples", "images"): token weights, summaries.
      dataset: the task's data (a `data.dataset.Dataset`), or None: `config.data`.
      inner_optimizer: an optax `GradientTransformation`, or None: `config.optim`'s.
      import_path: "module:function" that builds this task from a config in another process;
        empty for a task that exists only in this process.
    """

    name: str
    build_model: Callable[[nnx.Rngs], nnx.Module]
    train_loss: LossFn
    eval_metrics: MetricsFn
    batch_spec: P = _BATCH_SPEC
    is_mean_only: Callable[[str], bool] = _no_tensor
    state_policy: str = "average"
    tokens_per_example: int = 1
    token_unit: str = "examples"
    dataset: Any = None
    inner_optimizer: optax.GradientTransformation | None = None
    import_path: str = ""

    @classmethod
    def from_nnx(
        cls,
        build_model: Callable[[nnx.Rngs], nnx.Module],
        loss_fn: Callable[[nnx.Module, Batch], Any],
        metrics_fn: Callable[[nnx.Module, Batch], dict[str, Any]] | None = None,
        *,
        name: str = "",
        dataset: Any = None,
        inner_optimizer: optax.GradientTransformation | None = None,
        state_policy: str = "average",
        is_mean_only: Callable[[str], bool] = _no_tensor,
        batch_spec: P = _BATCH_SPEC,
        tokens_per_example: int = 1,
        token_unit: str = "examples",
        import_path: str = "",
    ) -> Task:
        """A task around the user's own model, loss and metrics.

        Args:
          build_model: `rngs -> nnx.Module`; any module (BatchNorm, Dropout, RNG streams).
          loss_fn: `(model, batch) -> loss` or `(loss, aux_dict)`, called in training mode
            (`model.train()`); the model's batch statistics and RNG state it updates are kept.
          metrics_fn: `(model, batch) -> dict of scalars`, called in evaluation mode with the
            loss and aux of `loss_fn`; optional.
          name: the task's name (default: the model class's), part of its identity.
          dataset: the task's data (`data.dataset.Dataset`), or None: `config.data`.
          inner_optimizer: any optax `GradientTransformation`, or None: `config.optim`'s.
          state_policy: "average" or "local" (see the module doc).
          is_mean_only: which tensors RDA merges by the plain mean (a predicate on the
            `/`-joined key path); default none.
          batch_spec: partition spec of the batch arrays (default: the leading axis over `data`).
          tokens_per_example: what one batch row counts as, in `token_unit`s.
          token_unit: the unit of the token counts (default "examples").
          import_path: "module:function" building this task from a config, for other processes
            (decoupled mode); `make_task` sets it for a task named by `config.task`.

        Raises:
          ConfigError: an unknown `state_policy`.
        """
        if state_policy not in STATE_POLICIES:
            raise ConfigError(
                f"Task.from_nnx(state_policy={state_policy!r}): expected one of {STATE_POLICIES}"
            )
        model = _abstract_model(build_model)
        synced_filter = _synced_filter(state_policy)
        is_key = key_mask(nnx.split(model, synced_filter, ...)[2])

        def forward(graphdef, synced, local, batch, train: bool):
            module = nnx.merge(graphdef, synced, _wrap_keys(local, is_key))
            module.train() if train else module.eval()
            out = loss_fn(module, batch)
            loss, aux = out if isinstance(out, tuple) else (out, {})
            _, synced_after, local_after = nnx.split(module, synced_filter, ...)
            return module, loss, aux, nnx.to_pure_dict(synced_after), nnx.to_pure_dict(local_after)

        def train_loss(graphdef, synced, local, batch):
            _, loss, aux, synced_after, local_after = forward(graphdef, synced, local, batch, True)
            return loss, (synced_after, jax.tree.map(_raw_key, local_after), aux)

        def eval_metrics(graphdef, synced, local, batch):
            module, loss, aux, _, _ = forward(graphdef, synced, local, batch, False)
            metrics = {"loss": loss, **aux}
            if metrics_fn is not None:
                metrics.update(metrics_fn(module, batch))
            return metrics

        return cls(
            name=name or type(model).__name__,
            build_model=build_model,
            train_loss=train_loss,
            eval_metrics=eval_metrics,
            batch_spec=batch_spec,
            is_mean_only=is_mean_only,
            state_policy=state_policy,
            tokens_per_example=tokens_per_example,
            token_unit=token_unit,
            dataset=dataset,
            inner_optimizer=inner_optimizer,
            import_path=import_path,
        )

    # The model's trees -------------------------------------------------------------------------

    def split_states(self, model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        """(graphdef, synced `nnx.State`, local `nnx.State`) of a model."""
        return nnx.split(model, _synced_filter(self.state_policy), ...)

    def split(self, model: nnx.Module) -> tuple[nnx.GraphDef, PyTree, PyTree]:
        """(graphdef, synced pure dict, local pure dict) of a model (RNG keys as raw key data)."""
        graphdef, synced, local = self.split_states(model)
        return graphdef, nnx.to_pure_dict(synced), jax.tree.map(_raw_key, nnx.to_pure_dict(local))

    def abstract_params(self) -> PyTree:
        """The synced tree's shapes and dtypes (`jax.ShapeDtypeStruct`s); nothing is computed."""
        _, synced, _ = self.split(_abstract_model(self.build_model))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), synced)

    def trainable(self) -> PyTree:
        """A bool tree like `abstract_params`: which leaves are `nnx.Param`s (differentiated)."""
        model = _abstract_model(self.build_model)
        names = {
            fragments.path_name(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(
                nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
            )[0]
        }
        return jax.tree_util.tree_map_with_path(
            lambda path, _: fragments.path_name(path) in names, self.abstract_params()
        )

    def is_averaged(self, name: str) -> bool:
        """Whether a synced tensor is state (batch statistics) replaced by the plain mean."""
        return name in self._averaged_names

    @functools.cached_property
    def _averaged_names(self) -> frozenset[str]:
        trainable = self.trainable()
        return frozenset(
            fragments.path_name(path)
            for path, is_param in jax.tree_util.tree_flatten_with_path(trainable)[0]
            if not is_param
        )

    def init_params(self, seed: int) -> PyTree:
        """Freshly initialised synced values (host numpy), as a learner of `seed` makes them.

        On one device, with no island: the syncer's version 0 (learners start from it).
        """
        with jax.set_mesh(_one_device_mesh()):
            synced = jax.jit(lambda key: self.split(self.build_model(nnx.Rngs(key)))[1])(
                jax.random.key(seed)
            )
        return jax.tree.map(np.asarray, jax.device_get(synced))

    def identity(self) -> str:
        """Names the task in fingerprints and errors: its import path, else its name."""
        return self.import_path or self.name

    def fingerprint(self, specs: list[fragments.TensorSpec] | None = None) -> str:
        """The task's identity and its synced tree's digest (checked at registration)."""
        specs = specs if specs is not None else fragments.tensor_specs(self.abstract_params())
        return f"{self.identity()}@{fragments.fingerprint(specs)}"

    def tokens_per_step(self, batch_size: int) -> int:
        """What one inner step of `batch_size` rows counts, in `token_unit`s."""
        return batch_size * self.tokens_per_example

    @property
    def classification(self) -> bool:
        """Whether evaluation reports accuracy (the built-in ViT)."""
        return self.name == "classification"


def _synced_filter(state_policy: str) -> Any:
    return nnx.Any(nnx.Param, nnx.BatchStat) if state_policy == "average" else nnx.Param


def _abstract_model(build_model: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    with jax.set_mesh(_one_device_mesh()):
        return nnx.eval_shape(lambda: build_model(nnx.Rngs(0)))


def _wrap_keys(local: PyTree, is_key: PyTree) -> PyTree:
    return jax.tree.map(lambda x, k: jax.random.wrap_key_data(x) if k else x, local, is_key)


def _raw_key(x: Any) -> Any:
    """A typed PRNG key as its raw key data (checkpointable); anything else as it is."""
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract model's
        return jax.eval_shape(jax.random.key_data, x)
    return jax.random.key_data(x)


def key_mask(local: nnx.State) -> PyTree:
    """A bool tree like `local`'s pure dict: which leaves are typed PRNG keys."""
    return jax.tree.map(
        lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key), nnx.to_pure_dict(local)
    )


def _one_device_mesh() -> jax.sharding.Mesh:
    return make_island_mesh((1, 1), jax.devices()[:1])


def from_functions(
    name: str,
    build_model: Callable[[nnx.Rngs], nnx.Module],
    train_loss: Callable[[nnx.GraphDef, PyTree, Batch], jax.Array],
    eval_metrics: Callable[[nnx.GraphDef, PyTree, Batch], dict[str, jax.Array]],
    **fields: Any,
) -> Task:
    """A task of a model with parameters only, from `(graphdef, params, batch)` functions.

    The built-in models are written this way: their loss merges the graph with the parameters.
    """

    def loss(graphdef, synced, local, batch):
        return train_loss(graphdef, synced, batch), (synced, local, {})

    def metrics(graphdef, synced, local, batch):
        return eval_metrics(graphdef, synced, batch)

    return Task(name, build_model, loss, metrics, **fields)


def _lm_metrics(
    graphdef: nnx.GraphDef, params: PyTree, batch: Batch, document_mask: bool = True
) -> dict:
    from decoupled_diloco.models.transformer import lm_loss

    return {"loss": lm_loss(graphdef, params, batch, document_mask)}


def model_config(config: ExperimentConfig) -> ModelConfig:
    """`config.model` with its vocabulary taken from the data where it is 0.

    Raises:
      ConfigError: a vocabulary that differs from the tokenizer's (`model_vocab_size`).
    """
    if config.model.kind == "vit" or config.data.dataset != "text":
        return config.model
    from decoupled_diloco.data.dataset import model_vocab_size

    return dataclasses.replace(config.model, vocab_size=model_vocab_size(config))


def _builtin_task(config: ExperimentConfig) -> Task:
    from decoupled_diloco.models.transformer import Transformer, is_embedding, lm_loss

    kind = config.model.kind
    model_cfg = model_config(config)
    mask = model_cfg.document_mask
    lm = {
        "batch_spec": P("data", None),
        "is_mean_only": lambda name: is_embedding(tuple(name.split("/"))),
        "tokens_per_example": config.model.seq_len,
        "token_unit": "tokens",
        "import_path": f"builtin:{kind}",
    }
    if kind == "transformer":
        return from_functions(
            "language_modeling",
            lambda rngs: Transformer(model_cfg, rngs),
            functools.partial(lm_loss, document_mask=mask),
            functools.partial(_lm_metrics, document_mask=mask),
            **lm,
        )
    if kind == "moe":
        from decoupled_diloco.models import moe

        return from_functions(
            "language_modeling",
            lambda rngs: moe.MoETransformer(model_cfg, config.moe, rngs),
            functools.partial(moe.moe_lm_loss, moe=config.moe, document_mask=mask),
            functools.partial(moe.moe_lm_metrics, document_mask=mask),
            **lm,
        )
    if kind == "vit":
        from decoupled_diloco.data import vision as vision_data
        from decoupled_diloco.models import vit

        side = DATASETS[config.data.dataset]
        return from_functions(
            "classification",
            lambda rngs: vit.ViT(config.model, (side, side, 1), vision_data.NUM_CLASSES, rngs),
            vit.classification_loss,
            vit.classification_metrics,
            is_mean_only=lm["is_mean_only"],
            token_unit="examples",
            import_path="builtin:vit",
        )
    raise ConfigError(f"config.model.kind: unknown kind {kind!r}")


def import_task_builder(path: str) -> Callable[[ExperimentConfig], Task]:
    """The function `module:function` names (`config.task`), imported.

    Raises:
      ConfigError: the path is malformed, or its module or function cannot be imported.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"config.task: {path!r} is not 'module:function' (e.g. 'mypkg.tasks:make_task')"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"config.task: cannot import module {module_name!r} ({error}); run from the "
            "directory that holds it or add it to PYTHONPATH"
        ) from None
    builder = getattr(module, attribute, None)
    if not callable(builder):
        raise ConfigError(f"config.task: module {module_name!r} has no function {attribute!r}")
    return builder


def python_path(config: ExperimentConfig) -> str:
    """PYTHONPATH for child processes that must import `config.task` as this process does.

    The directory its top-level package was imported from, and the current directory, go
    before the inherited PYTHONPATH (children run from the repository root).
    """
    import os
    import pathlib
    import sys

    parts = [os.getcwd()]
    module_name = config.task.partition(":")[0]
    module = sys.modules.get(module_name)
    if config.task and module is not None and getattr(module, "__file__", None):
        root = pathlib.Path(module.__file__).resolve().parent
        for _ in range(module_name.count(".") + (module.__file__.endswith("__init__.py"))):
            root = root.parent
        parts.insert(0, str(root))
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(dict.fromkeys(parts + ([inherited] if inherited else [])))


def make_task(config: ExperimentConfig) -> Task:
    """The task of `config`: the user's (`config.task`, imported) or the built-in model's."""
    if not config.task:
        return _builtin_task(config)
    task = import_task_builder(config.task)(config)
    if not isinstance(task, Task):
        raise ConfigError(
            f"config.task: {config.task} returned {type(task).__name__}, not a decoupled_diloco "
            "Task (build it with dd.Task.from_nnx)"
        )
    return dataclasses.replace(task, import_path=config.task)
