"""The held-out set a run evaluates on, and the text it stands for: bits per byte.

Every evaluation reports the mean next-token loss in nats per token over fixed validation
batches (the dataset's `validation_batches`: the same tokens whatever the mode, seed or number
of learners). A loss per token depends on the tokenizer; bits per byte does not:

    bpb = mean loss (nats/token) × target tokens / ln 2 / UTF-8 bytes of those targets

so a byte-level model, an 8k BPE and a published 50k-vocabulary result compare on the same
scale (docs/data.md, "Bits per byte"). It is reported wherever the dataset knows the bytes its
validation targets stand for (`validation_bytes`: the built-in byte corpus and prepared
directories; a user's dataset may declare it too) and the loss is the mean cross-entropy over
every target token, as the built-in transformer's and MoE's are.

`eval.sets` names more held-out sets (another prepared directory's validation split, say),
evaluated beside the run's own with the same batches and reported under their names
(`eval_NAME_loss`, `eval_NAME_bpb`).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from decoupled_diloco.config import ConfigError, ExperimentConfig
from decoupled_diloco.config.checks import eval_sets


def bits_per_byte(loss: float, targets: int, nbytes: int) -> float:
    """Bits per byte of text from a mean loss in nats over `targets` tokens of `nbytes` bytes."""
    return loss * targets / math.log(2) / nbytes


def count_targets(batches: list[Any]) -> int | None:
    """The next-token targets in token batches ((B, T+1) ids, or dicts with `tokens`); else None."""
    total = 0
    for batch in batches:
        tokens = batch.get("tokens") if isinstance(batch, Mapping) else batch
        array = np.asarray(tokens) if tokens is not None else None
        if array is None or array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            return None
        total += array.shape[0] * (array.shape[1] - 1)
    return total


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """Fixed validation batches and, where known, the text their targets stand for.

    Attributes:
      batches: the batches every evaluation runs on.
      targets: the next-token targets in them (None: not token data).
      nbytes: the UTF-8 bytes those targets stand for (None: the dataset does not say).
    """

    batches: list[Any]
    targets: int | None = None
    nbytes: int | None = None

    def with_bpb(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """`metrics` with `bpb` added from their `loss`, where the bytes are known."""
        out = dict(metrics)
        if self.targets and self.nbytes and "loss" in out and math.isfinite(out["loss"]):
            out["bpb"] = bits_per_byte(float(out["loss"]), self.targets, self.nbytes)
        return out


def held_out(dataset: Any, batch_size: int, num_batches: int) -> HeldOut:
    """The dataset's validation batches, their targets and (if it declares them) their bytes.

    Raises:
      ValueError: the dataset's validation split is too small (from `validation_batches`).
    """
    batches = dataset.validation_batches(batch_size, num_batches)
    targets = count_targets(batches)
    declared = getattr(dataset, "validation_bytes", None)
    nbytes = int(declared(batch_size, num_batches)) if targets and callable(declared) else None
    return HeldOut(batches, targets, nbytes or None)


def held_out_sets(config: ExperimentConfig, dataset: Any) -> dict[str, HeldOut]:
    """The run's own held-out set (named "") and each of `eval.sets`, in that order.

    Raises:
      ConfigError: a set that is not there, or tokenized with another tokenizer than the
        run's data (its token ids would mean other text), or sets beside a dataset of a
        user's own.
    """
    batch, count = config.data.batch_size, config.eval.batches
    sets = {"": held_out(dataset, batch, count)}
    for name, path in eval_sets(config.eval.sets).items():
        sets[name] = held_out(_named_set(config, dataset, name, path), batch, count)
    return sets


def evaluate_sets(
    sets: Mapping[str, HeldOut], metrics_of: Callable[[list[Any]], Mapping[str, float]]
) -> dict[str, float]:
    """Every set's metrics (`metrics_of(batches)`, with bits per byte).

    The run's own set's are unprefixed; each named set's are NAME_METRIC.
    """
    out: dict[str, float] = {}
    for name, held in sets.items():
        metrics = held.with_bpb(metrics_of(held.batches))
        out.update(metrics if not name else {f"{name}_{k}": v for k, v in metrics.items()})
    return out


def _named_set(config: ExperimentConfig, dataset: Any, name: str, path: str) -> Any:
    from decoupled_diloco.data import dataset as dataset_lib
    from decoupled_diloco.data import packed, shards
    from decoupled_diloco.data import text as text_lib
    from decoupled_diloco.data.tokenizer import ByteTokenizer

    where = f"config.eval.sets: {name}={path}"
    if isinstance(dataset, packed.PreparedDataset):
        mine = dataset.identity["tokenizer"]
    elif isinstance(dataset, dataset_lib.TextDataset):
        mine = None  # the byte corpus: ids 0..255, no end-of-document token
    else:
        raise ConfigError(f"{where}: held-out sets beside a dataset of your own are not read")
    if shards.is_prepared(path):
        other = packed.PreparedDataset(path, config.model.seq_len, verify=config.data.verify)
        theirs = other.identity["tokenizer"]
        if theirs != mine:
            raise ConfigError(
                f"{where}: prepared with tokenizer {theirs}; the run's data is "
                f"{mine or 'the byte corpus (give text files)'}: the same token ids must mean "
                "the same text (prepare it with the run's tokenizer)"
            )
        return other
    if not pathlib.Path(path).exists():
        raise ConfigError(f"{where}: no such file or directory")
    if mine not in (None, ByteTokenizer.digest):
        raise ConfigError(
            f"{where}: plain text is read as bytes, and this run's tokens are {mine}: prepare "
            "it with the run's tokenizer (python -m decoupled_diloco.data.prepare)"
        )
    corpus = text_lib.load_corpus(path, config.data.val_fraction)
    return dataset_lib.TextDataset(corpus, config.model.seq_len)
