"""Parameter fragments: balanced bin-packing of tensors and the staggered sync schedule.

Streaming / Decoupled DiLoCo sync the model one fragment at a time so that traffic is spread
over the H inner steps. Both the learner and the syncer cut the same parameter tree the same
way (the cut is a pure function of the tree's paths and shapes), so a fragment is named on the
wire by its index alone.

Schedule: fragment p of P is due at inner steps t >= 1 with t ≡ o_p (mod H), where
o_p = ⌊(p + 1)·H / P⌋. With P = 1 this is the DiLoCo schedule (t = H, 2H, ...); with P = H one
fragment goes out every step. A fragment pushed at step t is merged back into the live
parameters no earlier than step t + τ (`overlap_steps`), so τ steps of training overlap it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

PyTree = Any


def path_name(path: tuple) -> str:
    """A stable `/`-joined name for a pytree key path (dict keys, list indices, attributes)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one parameter tensor, in tree-flatten order (`index`)."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Size of the tensor in bytes."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def tensor_specs(params: PyTree) -> list[TensorSpec]:
    """Specs of every leaf of `params` (arrays or `ShapeDtypeStruct`s), in flatten order."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [
        TensorSpec(i, path_name(path), tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype).name)
        for i, (path, leaf) in enumerate(leaves)
    ]


def fingerprint(specs: Sequence[TensorSpec]) -> str:
    """A digest of the model's tree structure, shapes and dtypes (checked at registration)."""
    import hashlib

    text = ";".join(f"{s.name}:{'x'.join(map(str, s.shape))}:{s.dtype}" for s in specs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def partition(specs: Sequence[TensorSpec], num_fragments: int) -> list[list[TensorSpec]]:
    """Balanced greedy bin-packing: largest tensor first into the currently lightest fragment.

    Ties (equal sizes, equal loads) break by name and fragment index, so every process that
    sees the same tree gets the same cut. Within a fragment, tensors keep flatten order.

    Raises:
      ValueError: fewer tensors than fragments (a fragment would be empty).
    """
    if num_fragments < 1:
        raise ValueError(f"config.decoupled.fragments must be >= 1, got {num_fragments}")
    if len(specs) < num_fragments:
        raise ValueError(
            f"config.decoupled.fragments: {num_fragments} fragments but the model has only "
            f"{len(specs)} tensors"
        )
    loads = [0] * num_fragments
    bins: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    for spec in sorted(specs, key=lambda s: (-s.nbytes, s.name)):
        lightest = min(range(num_fragments), key=lambda p: (loads[p], p))
        bins[lightest].append(spec)
        loads[lightest] += spec.nbytes
    return [sorted(b, key=lambda s: s.index) for b in bins]


def offset(fragment: int, num_fragments: int, inner_steps: int) -> int:
    """o_p = ⌊(p + 1)·H / P⌋: the step (mod H) at which fragment p is due."""
    return ((fragment + 1) * inner_steps) // num_fragments


def gather(leaves: Sequence[Any], fragment: Sequence[TensorSpec]) -> list[Any]:
    """The leaves of one fragment, in its order."""
    return [leaves[s.index] for s in fragment]
