"""The `Dataset` protocol every mode trains from, the built-in datasets, and which one a run uses.

A dataset gives each learner its own training iterator (its shard), the same fixed validation
batches to everyone, and a description for `summary.json`:

    class MyData:
        def train_iterator(self, batch_size, learner_id, num_learners, seed): ...
        def validation_batches(self, batch_size, num_batches): ...   # a list of batches
        def describe(self): return "dataset", {"name": "mine"}       # optional
        def validation_bytes(self, batch_size, num_batches): ...     # optional: bits per byte

A training iterator yields batches (an array with a leading batch axis, or a dict of them). A
grain `DatasetIterator` (or any iterator with `get_state`/`set_state`) can be checkpointed; a
plain generator or numpy iterator works too, but only in runs without checkpoints
(`checkpoint.every = 0`): `check_checkpointable` says so when the run starts. A dataset of
token windows that says how many UTF-8 bytes of text its validation targets stand for
(`validation_bytes`) gets bits per byte in every evaluation (`data.heldout`).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

from decoupled_diloco.config import ConfigError, ExperimentConfig
from decoupled_diloco.data import packed
from decoupled_diloco.data import shards as shards_lib
from decoupled_diloco.data import text as data_lib

Batch = Any


@runtime_checkable
class Dataset(Protocol):
    """Training shards and validation batches of one task's data."""

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int) -> Any:
        """Learner `learner_id`'s iterator of training batches (checkpointable if it can be)."""

    def validation_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """Fixed validation batches, the same in every mode and for every learner."""


def describe(dataset: Any) -> tuple[str, dict[str, Any]]:
    """(summary key, facts about the data): the dataset's own `describe`, else its type."""
    if hasattr(dataset, "describe"):
        return dataset.describe()
    return "dataset", {"name": type(dataset).__name__}


def check_checkpointable(iterator: Any, config: ExperimentConfig) -> None:
    """Refuses, at the start of a run with checkpoints, an iterator that cannot be checkpointed.

    Raises:
      ConfigError: `checkpoint.every` > 0 and the iterator lacks `get_state` or `set_state`.
    """
    if not config.checkpoint.every:
        return
    missing = [
        name for name in ("get_state", "set_state") if not callable(getattr(iterator, name, None))
    ]
    if missing:
        raise ConfigError(
            f"config.checkpoint.every={config.checkpoint.every}: the dataset's training iterator "
            f"({type(iterator).__name__}) has no {' or '.join(missing)}, so its position cannot "
            "be checkpointed; return a grain DatasetIterator (iter(grain.MapDataset...."
            "to_iter_dataset())), add get_state()/set_state(state) methods, or set "
            "checkpoint.every=0"
        )


class TextDataset:
    """The byte-level corpus cut into `seq_len + 1`-token windows (see `data/text.py`)."""

    def __init__(self, corpus: data_lib.Corpus, seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len

    def train_iterator(self, batch_size: int, learner_id: int, num_learners: int, seed: int):
        """See `data.text.train_iterator`."""
        return data_lib.train_iterator(
            self.corpus.train_BN, self.seq_len, batch_size, learner_id, num_learners, seed
        )

    def validation_batches(self, batch_size: int, num_batches: int) -> list[np.ndarray]:
        """See `data.text.validation_batches`."""
        return data_lib.validation_batches(
            self.corpus.val_BN, self.seq_len, batch_size, num_batches
        )

    def validation_bytes(self, batch_size: int, num_batches: int) -> int:
        """The bytes the validation targets stand for: one per target (the corpus is bytes)."""
        return num_batches * batch_size * self.seq_len

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
        """See `data.vision.train_iterator`."""
        from decoupled_diloco.data import vision as vision_data

        return vision_data.train_iterator(
            self.images, batch_size, learner_id, num_learners, seed, self.augment
        )

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """See `data.vision.validation_batches`."""
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


def load_dataset(config: ExperimentConfig, preloaded: Any = None, task: Any = None) -> Any:
    """The data a run trains on: `preloaded`, else the task's, else `config.data`'s.

    Args:
      config: the experiment.
      preloaded: a `Dataset`, a text `data.text.Corpus` or an `ImageData` to use instead of
        loading; None: the task's dataset, else loaded from `config.data`.
      task: the run's `tasks.Task` (its `dataset`, if it carries one).

    Raises:
      ConfigError: a user's task (`config.task`) that carries no dataset and was given none.
    """
    if preloaded is not None and hasattr(preloaded, "validation_batches"):
        return preloaded
    if preloaded is None and task is not None and task.dataset is not None:
        return task.dataset
    users = config.task or (task is not None and not task.import_path.startswith("builtin:"))
    if preloaded is None and users:
        raise ConfigError(
            f"task {config.task or task.identity()!r} carries no dataset (config.data describes "
            "the built-in models' data only); give one to Task.from_nnx(..., dataset=...) or "
            "pass dataset= to train_and_evaluate"
        )
    if config.data.dataset == "text":
        if preloaded is None and shards_lib.is_prepared(config.data.path):
            return packed.PreparedDataset(
                config.data.path, config.model.seq_len, verify=config.data.verify
            )
        corpus = preloaded or data_lib.load_corpus(config.data.path, config.data.val_fraction)
        return TextDataset(corpus, config.model.seq_len)
    from decoupled_diloco.data import vision as vision_data

    images = preloaded or vision_data.load_images(config.data.dataset, config.data.val_fraction)
    return ImageDataset(images, config.data.augment)


def model_vocab_size(config: ExperimentConfig) -> int:
    """The built-in LM's vocabulary for `config.data`: `model.vocab_size`, or the data's.

    On a prepared directory (its manifest is read, nothing else) 0 means the tokenizer's
    vocabulary padded to a multiple of `packed.VOCAB_MULTIPLE`; on the byte corpus, 256.

    Raises:
      ConfigError: a `model.vocab_size` that is neither the tokenizer's vocabulary nor its
        padded size, one below 256 on the byte corpus, or a padded size that the model axis
        does not divide.
    """
    given = config.model.vocab_size
    path = config.data.path
    if not shards_lib.is_prepared(path):
        if given and given < 256:
            raise ConfigError(
                f"config.model.vocab_size={given}: the byte corpus at {path or 'the stdlib'} "
                "has ids up to 255 (0: take it from the data)"
            )
        return given or 256
    try:
        vocab = int(shards_lib.read_manifest(pathlib.Path(path))["tokenizer"]["vocab_size"])
    except shards_lib.PreparedDataError as error:
        raise ConfigError(f"config.data.path: {error}") from None
    padded = packed.padded_vocab(vocab)
    if given and given not in (vocab, padded):
        raise ConfigError(
            f"config.model.vocab_size={given} differs from the tokenizer's vocabulary {vocab} "
            f"of {path} (padded: {padded}); set it to 0 to take it from the tokenizer"
        )
    size = given or padded
    model_axis = config.mesh.shape[1]
    if size % model_axis:
        raise ConfigError(
            f"config.model.vocab_size: the model axis {model_axis} does not divide the "
            f"vocabulary {size} of {path}; set model.vocab_size to a multiple of both"
        )
    return size


DATA_STAMP = "data.json"  # in a workdir: the data its checkpoints were trained on


def data_identity(config: ExperimentConfig) -> dict[str, str] | None:
    """What names `config.data`'s token stream: the tokenizer's digest and the corpus's.

    A prepared directory's come from its manifest (nothing else is read); the byte corpus is
    "bytes:raw"; a user's task or an image set: None.
    """
    if config.task or config.data.dataset != "text":
        return None
    if not shards_lib.is_prepared(config.data.path):
        return {"tokenizer": "bytes:raw"}
    manifest = shards_lib.read_manifest(pathlib.Path(config.data.path))
    return packed.identity(manifest)


def check_workdir_data(config: ExperimentConfig, workdir: pathlib.Path) -> None:
    """Refuses to resume `workdir` on other data than it was trained on; records the data.

    Raises:
      ConfigError: the workdir's `data.json` names another tokenizer or corpus.
    """
    identity = data_identity(config)
    if identity is None:
        return
    stamp = workdir / DATA_STAMP
    if stamp.is_file() and config.checkpoint.every:  # (without checkpoints: nothing to resume)
        saved = json.loads(stamp.read_text())
        if saved.get("tokenizer") != identity["tokenizer"]:
            raise ConfigError(
                f"config.data.path: {workdir} was trained on data tokenized by "
                f"{saved.get('tokenizer')!r}; {config.data.path or 'the byte corpus'} is "
                f"tokenized by {identity['tokenizer']!r}. Resume on the data it was trained on, "
                "or use a fresh workdir"
            )
        if saved.get("corpus") != identity.get("corpus"):
            raise ConfigError(
                f"config.data.path: {workdir} was trained on corpus {saved.get('corpus')!r}; "
                f"{config.data.path} holds corpus {identity.get('corpus')!r} (prepared again?). "
                "Resume on the data it was trained on, or use a fresh workdir"
            )
        return
    workdir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({**identity, "path": str(config.data.path)}) + "\n")
