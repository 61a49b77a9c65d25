"""Memory planning before anything runs: what one device of an island needs for its step.

`plan` compiles the island's inner step for a batch's shape (no arrays are allocated) and
reads, per device, the bytes of the parameters, the inner optimizer state and the learner's
own state from their shardings, and XLA's temporaries (activations, gradients, workspace) from
the compiled step's `memory_analysis()`. `check` refuses a plan that cannot fit a device and
says by how much, and what would fit: FSDP for the parameters and moments, `model.remat` for
the activations, or more devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from decoupled_diloco.config import ConfigError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device of an island holds during an inner step.

    Attributes:
      params: the synced tree's shard (parameters, synced statistics).
      opt_state: the inner optimizer state's shard.
      local: the learner's own state (RNG keys, local statistics).
      temp: XLA's temporaries of the compiled step (activations and the like).
      batch: the batch's shard.
      mesh: the island's (data, model) shape; fsdp: whether parameters are split over data.
    """

    params: int
    opt_state: int
    local: int
    temp: int
    batch: int
    mesh: tuple[int, int]
    fsdp: bool

    @property
    def total(self) -> int:
        """Everything at once (the step's outputs reuse its donated inputs)."""
        return self.params + self.opt_state + self.local + self.temp + self.batch

    def describe(self) -> str:
        """One line for logs: each part in GB."""
        parts = ("params", "opt_state", "local", "temp", "batch")
        return ", ".join(f"{k} {getattr(self, k) / GB:.3f}" for k in parts) + (
            f"; total {self.total / GB:.3f} GB per device"
        )


def per_device_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every leaf (`ShapeDtypeStruct`s with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def plan(island: Any, batch: Any) -> MemoryPlan:
    """Compiles `island`'s step for `batch`'s shapes (arrays or `ShapeDtypeStruct`s); the plan."""
    abstract_batch = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=island.batch_sharding)
            if not isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        batch,
    )
    with jax.set_mesh(island.mesh):
        compiled = island.jitted_step.lower(island.abstract_state, abstract_batch).compile()
    stats = compiled.memory_analysis()
    state = island.abstract_state
    return MemoryPlan(
        params=per_device_bytes(state.params),
        opt_state=per_device_bytes(state.opt_state),
        local=per_device_bytes(state.local),
        temp=int(getattr(stats, "temp_size_in_bytes", 0)) if stats is not None else 0,
        batch=per_device_bytes(abstract_batch),
        mesh=(island.mesh.shape["data"], island.mesh.shape["model"]),
        fsdp=island.config.mesh.fsdp,
    )


def device_limit(config: Any, device: jax.Device) -> int:
    """Bytes a device may hold: `mesh.device_memory_gb`, else what the device reports (0: none)."""
    if config.mesh.device_memory_gb > 0:
        return int(config.mesh.device_memory_gb * GB)
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats (CPU)
        stats = {}
    return int(stats.get("bytes_limit", 0))


def check(memory: MemoryPlan, limit: int) -> None:
    """Refuses a plan that needs more than `limit` bytes per device (0: no limit).

    Raises:
      ConfigError: naming the bytes and what would fit.
    """
    if limit <= 0 or memory.total <= limit:
        return
    data, model = memory.mesh
    hints = []
    if not memory.fsdp and data > 1:
        sharded = (memory.params + memory.opt_state) / data
        saved = memory.params + memory.opt_state - sharded
        hints.append(
            f"--config.mesh.fsdp=True splits parameters and optimizer state over the {data} "
            f"data devices (saves ~{saved / GB:.2f} GB per device)"
        )
    hints.append("--config.model.remat=True recomputes activations (cuts most of 'temp')")
    need = math.ceil(memory.total / limit)
    hints.append(
        f"or about {need}x the devices per island (config.mesh.shape, e.g. "
        f"({data * need}, {model}) with fsdp)"
    )
    raise ConfigError(
        f"config.mesh: the inner step needs {memory.total / GB:.2f} GB per device "
        f"({memory.describe()}), more than the {limit / GB:.2f} GB a device holds "
        f"(mesh.device_memory_gb or the device's own limit). To fit: " + "; ".join(hints)
    )


def check_island(island: Any, batch: Any = None) -> MemoryPlan | None:
    """`check` for an island against its devices' limit (`device_limit`); the plan, if checked.

    Without `batch` only the state's shards are counted (nothing is compiled): call it before
    `init`, and again with the first batch before the first step.
    """
    limit = device_limit(island.config, island.mesh.devices.flat[0])
    if limit <= 0:
        return None
    if batch is None:
        state = island.abstract_state
        mesh = (island.mesh.shape["data"], island.mesh.shape["model"])
        memory = MemoryPlan(
            per_device_bytes(state.params),
            per_device_bytes(state.opt_state),
            per_device_bytes(state.local),
            0,
            0,
            mesh,
            island.config.mesh.fsdp,
        )
    else:
        memory = plan(island, batch)
    check(memory, limit)
    return memory
