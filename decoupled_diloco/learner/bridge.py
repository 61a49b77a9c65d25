"""How a link moves values between its island's devices and the host, and who talks to the syncer.

A `DecoupledSync` does every device<->host move and every decision that its island's processes
must agree on through a `HostBridge`. `LocalBridge` is the island of one process (the default).
A multi-process island's bridge (`learner.multihost.CollectiveBridge`) does the same moves as
collectives: only its leader talks to the syncer, and what the leader hears (the merges ready
now, which round trips are under way, the fragments pulled at joining) is broadcast so that
every process applies and pushes the same fragments at the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np

from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.learner.round_trip import Inbound

Anchors = tuple[list[list[np.ndarray]], list[int]]  # per fragment: the global values, version


class HostBridge(Protocol):
    """What a link needs of its island (see the module doc).

    Attributes:
      talks: this process talks to the syncer (registers, pushes, pulls, heartbeats).
      alone: this process is the whole island, so it may act at once on what only it hears:
        a push refused as late is rebased, one refused as covered restarts its fragment's
        count, and a learner ahead's push phase is taken (`decoupled.align_phase`).
    """

    talks: bool
    alone: bool

    def to_host(self, leaves: Sequence[jax.Array]) -> list[np.ndarray]:
        """Host copies of (this island's) device arrays."""
        ...

    def place(self, value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """A host value onto the island's devices."""
        ...

    def join(self, pull: Callable[[], Anchors], partition: list[list[TensorSpec]]) -> Anchors:
        """The global fragments every process starts from (`pull`: register and pull them)."""
        ...

    def take_ready(
        self,
        take: Callable[[], dict[int, Inbound]],
        in_flight: Callable[[int], bool],
        partition: list[list[TensorSpec]],
    ) -> dict[int, Inbound]:
        """The merges to apply at this step boundary (`take`: those ready here)."""
        ...

    def under_way(self, p: int, in_flight: Callable[[int], bool]) -> bool:
        """Whether fragment p's round trip counts as under way (`in_flight`: as seen here)."""
        ...

    def merged(self, step: int, p: int, version: int, leaves: list[jax.Array]) -> None:
        """Fragment p's merge of `version` was applied after `step` (its values `leaves`)."""
        ...


class LocalBridge:
    """The island of one process: plain `device_get` / `device_put`; it alone talks."""

    talks = True
    alone = True

    def to_host(self, leaves: Sequence[jax.Array]) -> list[np.ndarray]:
        """Host copies (`device_get`)."""
        return [np.asarray(x) for x in jax.device_get(list(leaves))]

    def place(self, value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """`device_put` onto `sharding`."""
        return jax.device_put(value, sharding)

    def join(self, pull: Callable[[], Anchors], partition: list[list[TensorSpec]]) -> Anchors:
        """What `pull` pulls."""
        del partition
        return pull()

    def take_ready(
        self,
        take: Callable[[], dict[int, Inbound]],
        in_flight: Callable[[int], bool],
        partition: list[list[TensorSpec]],
    ) -> dict[int, Inbound]:
        """What is ready here."""
        del in_flight, partition
        return take()

    def under_way(self, p: int, in_flight: Callable[[int], bool]) -> bool:
        """As seen here."""
        return in_flight(p)

    def merged(self, step: int, p: int, version: int, leaves: list[jax.Array]) -> None:
        """Nothing to record."""
        del step, p, version, leaves
