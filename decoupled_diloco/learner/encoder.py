"""Outer-gradient compression on a learner's own mesh, with the error-feedback residual.

One jit-compiled function (`core.compression.encode_fragment`) encodes a fragment's
Δ = anchor − θ where the parameters live; only the (small) encoding comes to the host. With
error feedback the residual, a parameters-like pytree on the mesh, holds what was not sent
yet; it is part of the learner's checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco.comm import wire
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import compression, fragments
from decoupled_diloco.learner.round_trip import Encoded


class MeshEncoder:
    """Encodes fragments on the mesh (`enabled` unless `compression.scheme` is "none").

    Args:
      config: the experiment (`compression`).
      partition: each fragment's tensor specs (`core.fragments.partition`).
      abstract_params: the parameter tree's shapes and dtypes.
      shardings: the parameters' shardings (same tree).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        partition: Sequence[Sequence[fragments.TensorSpec]],
        abstract_params: Any,
        shardings: Any,
    ):
        z = config.compression
        self.partition, self.treedef = partition, jax.tree.structure(abstract_params)
        self.shardings = self.treedef.flatten_up_to(shardings)
        self.codec = compression.codec_for(z)
        self.enabled = z.scheme != "none"
        self._encode = jax.jit(
            functools.partial(compression.encode_fragment, codec=self.codec, decay=z.ef_decay)
        )
        self.residual: Any = None  # error feedback: a params-like pytree on the mesh
        if z.error_feedback:
            self.residual = jax.tree.map(
                lambda s, sharding: jax.device_put(np.zeros(s.shape, s.dtype), sharding),
                abstract_params,
                shardings,
            )
        # keep_unsent: per fragment, whether θ already holds the residual (it stays in the
        # buffer too, so that a checkpoint keeps it: a restart starts θ from the global values).
        self.in_params = [False] * len(partition)

    def forget(self, p: int) -> None:
        """Zeroes fragment p's residual (its push was refused; the next one sends it all)."""
        leaves = self.residual_leaves()
        if leaves is None:
            return
        for spec in self.partition[p]:
            leaves[spec.index] = jnp.zeros_like(leaves[spec.index])
        self.residual = jax.tree.unflatten(self.treedef, leaves)
        self.in_params[p] = False

    def residual_leaves(self) -> list[jax.Array] | None:
        """The residual's leaves in flatten order (None without error feedback)."""
        return None if self.residual is None else self.treedef.flatten_up_to(self.residual)

    def warm_up(self, anchors: Sequence[Sequence[np.ndarray]], leaves: Sequence[jax.Array]) -> None:
        """Compiles every fragment's encoder now, not in the step loop."""
        residual = self.residual_leaves()
        for p, frag in enumerate(self.partition):
            jax.block_until_ready(
                self._encode(
                    anchors[p],
                    fragments.gather(leaves, frag),
                    None if residual is None else fragments.gather(residual, frag),
                )
            )

    def encode(self, p: int, anchor: Sequence[np.ndarray], leaves: list[jax.Array]) -> Encoded:
        """Encodes fragment p's Δ = anchor − θ (error feedback: updates the residual).

        Waits for the (small) result, so that the next step may donate the parameters and
        no second multi-device program is queued behind it.
        """
        residual_leaves = self.residual_leaves()
        residual = None
        if residual_leaves is not None:
            residual = fragments.gather(residual_leaves, self.partition[p])
            if self.in_params[p]:  # keep_unsent: θ holds it, so Δ = anchor − θ does
                residual = [jnp.zeros_like(x) for x in residual]
                self.in_params[p] = False
        sections, new_residual = self._encode(anchor, leaves, residual)
        sections = jax.device_get(sections)
        if new_residual is not None:
            for spec, value in zip(self.partition[p], new_residual, strict=True):
                residual_leaves[spec.index] = jax.device_put(value, self.shardings[spec.index])
            self.residual = jax.tree.unflatten(self.treedef, residual_leaves)
        return Encoded(wire.encoded_arrays(sections, self.partition[p], self.codec))
