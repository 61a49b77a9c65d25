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


def fsdp_spec(spec: jax.sharding.PartitionSpec, shape: Sequence[int], data: int):
    """`spec` with the `data` axis added on the largest dimension it divides and nothing splits.

    A tensor no such dimension exists for (a scalar, or all dimensions too small or taken)
    keeps `spec`: it stays replicated over `data`.
    """
    if data <= 1 or "data" in jax.tree.leaves(tuple(spec)):
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [
        i
        for i, (e, n) in enumerate(zip(entries, shape, strict=True))
        if e is None and n % data == 0
    ]
    if not free:
        return spec
    entries[max(free, key=lambda i: (shape[i], -i))] = "data"
    return jax.sharding.PartitionSpec(*entries)
