"""The island mesh every built-in model is sharded over: (`data`, `model`) axes."""

from __future__ import annotations

from collections.abc import Sequence

import jax

AXES = ("data", "model")


def make_island_mesh(shape: tuple[int, int], devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
    """A (`data`, `model`) mesh over exactly `devices`, with explicit Auto axis types.

    Raises:
      ValueError: the mesh shape does not match the number of devices.
    """
    if shape[0] * shape[1] != len(devices):
        raise ValueError(
            f"config.mesh.shape {tuple(shape)} needs {shape[0] * shape[1]} devices, "
            f"got {len(devices)}"
        )
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh(tuple(shape), AXES, axis_types=(auto, auto), devices=list(devices))
