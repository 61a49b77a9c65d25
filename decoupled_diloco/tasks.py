"""Tasks: which model trains on which data, and how its loss and metrics are computed.

The island, the trainers, the learner and the launcher are task-agnostic: they ask the task for
the model, the training loss, the evaluation metrics and the batch layout, and the dataset for
per-learner iterators and fixed validation batches. `config.model.kind` picks the task:

  * "transformer": the dense byte-level LM (`models.transformer.Transformer` and `lm_loss`,
    `data/text.py`), compiled to the same program as before tasks existed.
  * "moe": the same data with `models.moe.MoETransformer`; the training loss adds the router
    losses, evaluation reports the cross-entropy (`loss`) and the routing statistics.
  * "vit": image classification (`models.vit.ViT`, `data/vision.py`); evaluation adds `accuracy`.

Every evaluation returns a dict with at least `loss`; classification tasks also `accuracy`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from decoupled_diloco.config import DATASETS, ExperimentConfig
from decoupled_diloco.data import text as data_lib
from decoupled_diloco.models.mesh import make_island_mesh
from decoupled_diloco.models.transformer import Params, Transformer, is_embedding, lm_loss

Batch = Any  # an int32 (B, T+1) token array, or a dict of arrays with a leading batch axis


@dataclasses.dataclass(frozen=True)
class Task:
    """What an island needs to know about the model and its loss.

    Attributes:
      name: "language_modeling" or "classification".
      build_model: builds the NNX module from an `nnx.Rngs`.
      train_loss: (graphdef, params, batch) -> scalar loss that is differentiated.
      eval_metrics: (graphdef, params, batch) -> dict of scalars, at least `loss`.
      batch_spec: partition spec of every batch array over the island mesh (`data` first).
      is_mean_only: a predicate on a tensor's `/`-joined path: the tensors that RDA merges
        by the plain weighted mean (default: the embedding tables, as in Decoupled DiLoCo).
    """

    name: str
    build_model: Callable[[nnx.Rngs], nnx.Module]
    train_loss: Callable[[nnx.GraphDef, Params, Batch], jax.Array]
    eval_metrics: Callable[[nnx.GraphDef, Params, Batch], dict[str, jax.Array]]
    batch_spec: P
    is_mean_only: Callable[[str], bool] = lambda name: is_embedding(tuple(name.split("/")))

    def abstract_params(self) -> Params:
        """The parameter tree's shapes and dtypes (`jax.ShapeDtypeStruct`s); nothing is computed."""
        with jax.set_mesh(_one_device_mesh()):
            model = nnx.eval_shape(lambda: self.build_model(nnx.Rngs(0)))
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
            nnx.to_pure_dict(nnx.split(model, nnx.Param)[1]),
        )

    def init_params(self, seed: int) -> Params:
        """Freshly initialised parameters as host numpy arrays, as a learner of `seed` makes them.

        On one device, with no island: the syncer's version 0 (learners start from it).
        """
        with jax.set_mesh(_one_device_mesh()):
            params = jax.jit(lambda key: _params(self.build_model(nnx.Rngs(key))))(
                jax.random.key(seed)
            )
        return jax.tree.map(np.asarray, jax.device_get(params))

    @property
    def classification(self) -> bool:
        """Whether evaluation reports accuracy."""
        return self.name == "classification"


def _one_device_mesh() -> jax.sharding.Mesh:
    return make_island_mesh((1, 1), jax.devices()[:1])


def _params(model: nnx.Module) -> Params:
    return nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])


def _lm_metrics(graphdef: nnx.GraphDef, params: Params, tokens_BT1: jax.Array) -> dict:
    return {"loss": lm_loss(graphdef, params, tokens_BT1)}


def make_task(config: ExperimentConfig) -> Task:
    """The task of `config.model.kind`."""
    kind = config.model.kind
    if kind == "transformer":
        return Task(
            name="language_modeling",
            build_model=lambda rngs: Transformer(config.model, rngs),
            train_loss=lm_loss,
            eval_metrics=_lm_metrics,
            batch_spec=P("data", None),
        )
    if kind == "moe":
        from decoupled_diloco.models import moe

        return Task(
            name="language_modeling",
            build_model=lambda rngs: moe.MoETransformer(config.model, config.moe, rngs),
            train_loss=functools.partial(moe.moe_lm_loss, moe=config.moe),
            eval_metrics=moe.moe_lm_metrics,
            batch_spec=P("data", None),
        )
    if kind == "vit":
        from decoupled_diloco.data import vision as vision_data
        from decoupled_diloco.models import vit

        side = DATASETS[config.data.dataset]
        return Task(
            name="classification",
            build_model=lambda rngs: vit.ViT(
                config.model, (side, side, 1), vision_data.NUM_CLASSES, rngs
            ),
            train_loss=vit.classification_loss,
            eval_metrics=vit.classification_metrics,
            batch_spec=P("data"),  # a prefix: the leading (batch) axis of every array
        )
    raise ValueError(f"config.model.kind: unknown kind {kind!r}")


class Dataset(Protocol):
    """Training shards and validation batches of one task's data."""

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int) -> Any:
        """Learner `learner_id`'s checkpointable iterator of training batches."""

    def validation_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """Fixed validation batches, the same in every mode and for every learner."""

    def describe(self) -> tuple[str, dict[str, Any]]:
        """(summary key, facts about the data) for `summary.json`."""


class TextDataset:
    """The byte-level corpus cut into `seq_len + 1`-token windows (see `data/text.py`)."""

    def __init__(self, corpus: data_lib.Corpus, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int):
        """See `data.train_iterator`."""
        return data_lib.train_iterator(
            self.corpus.train_BN, self.seq_len, batch_size, learner_id, num_learners, seed
        )

    def validation_batches(self, batch_size: int, num_batches: int) -> list[np.ndarray]:
        """See `data.validation_batches`."""
        return data_lib.validation_batches(
            self.corpus.val_BN, self.seq_len, batch_size, num_batches
        )

    def describe(self) -> tuple[str, dict[str, Any]]:
        """The corpus root, file count and split sizes in tokens."""
        c = self.corpus
        return "corpus", {
            "root": c.root,
            "files": c.num_files,
            "train_tokens": len(c.train_BN),
            "val_tokens": len(c.val_BN),
        }


class ImageDataset:
    """An image classification set (see `data/vision.py`)."""

    def __init__(self, images: Any, augment: bool):
        self.images, self.augment = images, augment

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int):
        """See `vision_data.train_iterator`."""
        from decoupled_diloco.data import vision as vision_data

        return vision_data.train_iterator(
            self.images, batch_size, learner_id, num_learners, seed, self.augment
        )

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """See `vision_data.validation_batches`."""
        from decoupled_diloco.data import vision as vision_data

        return vision_data.validation_batches(self.images, batch_size, num_batches)

    def describe(self) -> tuple[str, dict[str, Any]]:
        """The dataset name, image shape and split sizes in examples."""
        i = self.images
        return "dataset", {
            "name": i.name,
            "image_shape": list(i.image_shape),
            "train_examples": len(i.train.labels),
            "val_examples": len(i.val.labels),
            "augment": self.augment,
        }


def load_dataset(config: ExperimentConfig, preloaded: Any = None) -> Dataset:
    """The data of `config.data.dataset`.

    Args:
      config: the experiment.
      preloaded: a `data.Corpus` (text), an `ImageData` (images) or a `Dataset` to use
        instead of loading; None loads from `config.data`.
    """
    if preloaded is not None and hasattr(preloaded, "validation_batches"):
        return preloaded
    if config.data.dataset == "text":
        corpus = preloaded or data_lib.load_corpus(config.data.path, config.data.val_fraction)
        return TextDataset(corpus, config.model.seq_len)
    from decoupled_diloco.data import vision as vision_data

    images = preloaded or vision_data.load_images(config.data.dataset, config.data.val_fraction)
    return ImageDataset(images, config.data.augment)
