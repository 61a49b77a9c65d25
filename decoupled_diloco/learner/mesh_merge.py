"""A merged fragment onto the learner's mesh: `core.outer.merge_back`, compiled per fragment.

Merging back is one compiled call per fragment (not a few eager ops per tensor), warmed up when
the learner joins so that no fragment's first merge stalls the step loop for a compile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from decoupled_diloco.core import fragments as F
from decoupled_diloco.core import outer


@functools.partial(jax.jit, static_argnames=("alpha",))
def merge_fragment(
    merged: list[jax.Array],
    local: list[jax.Array],
    at_push: list[jax.Array | None],
    unsent: list[jax.Array | None],
    alpha: float,
) -> list[jax.Array]:
    """`core.outer.merge_back` over one fragment's tensors, compiled once per fragment."""
    return [
        outer.merge_back(m, x, at_push=a, unsent=u, alpha=alpha)
        for m, x, a, u in zip(merged, local, at_push, unsent, strict=True)
    ]


@jax.jit
def device_copy(leaves: list[jax.Array]) -> list[jax.Array]:
    """Device copies of a fragment's tensors (the next step donates the originals)."""
    return [jnp.copy(x) for x in leaves]


def merge_into(
    leaves: list[jax.Array],
    frag: Sequence[F.TensorSpec],
    merged: list[jax.Array],
    at_push: list[jax.Array] | None,
    residual: list[jax.Array] | None,
    alpha: float,
) -> None:
    """Merges an arrived fragment into the parameters' `leaves`, in place (one compiled call).

    Args:
      leaves: all the parameters' leaves (the fragment's are replaced).
      frag: the fragment's tensor specs.
      merged: the merged global values, placed on the learner's mesh.
      at_push: the fragment's values at the push it answers (`keep_overlap`), or None.
      residual: all the error-feedback residual's leaves when it moves into the parameters
        now (`keep_unsent`), or None.
      alpha: the merge-back's mixing weight.
    """
    none = [None] * len(frag)
    new = merge_fragment(
        merged,
        F.gather(leaves, frag),
        none if at_push is None else at_push,
        none if residual is None else F.gather(residual, frag),
        alpha=alpha,
    )
    for spec, value in zip(frag, new, strict=True):
        leaves[spec.index] = value


def warm_up(
    cut: Sequence[Sequence[F.TensorSpec]],
    leaves: list[jax.Array],
    residual: list[jax.Array] | None,
    keep_overlap: bool,
    alpha: float,
) -> None:
    """Compiles every fragment's merge-back (and overlap copy) by running it on `leaves`.

    Args:
      cut: the fragments' tensor specs.
      leaves: the joined parameters' leaves (the results are dropped).
      residual: the error-feedback residual's leaves, when `keep_unsent` adds it back.
      keep_overlap: whether merges keep the steps since the push (`at_push` copies).
      alpha: the merge-back's mixing weight.
    """
    for frag in cut:
        local = F.gather(leaves, frag)
        scratch = list(leaves)  # the same call `merge_into` makes at a merge, results dropped
        merge_into(
            scratch, frag, local, device_copy(local) if keep_overlap else None, residual, alpha
        )
        jax.block_until_ready(F.gather(scratch, frag))
