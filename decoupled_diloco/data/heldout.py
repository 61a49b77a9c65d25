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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np


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
