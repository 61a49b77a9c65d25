r"""Multi-process islands: one learner run as P processes on JAX's multi-controller runtime.

  # on each of the P hosts of island 0 (process_id 0..P-1; process 0 is the leader):
  DD_RUN_TOKEN=secret python -m decoupled_diloco.learner --syncer=SYNCER:50051 \
      --learner_id=0 --coordinator=HOST0:8476 --num_processes=2 --process_id=$I \
      --config=experiments/configs/tiny_lm.py --config.mode=decoupled

The processes of an island call `jax.distributed.initialize` and so form one JAX program: one
global mesh over all their devices (`jax.devices()`), the same jit-compiled inner step run by
every process on its own devices (XLA's collectives span processes; on CPU they use gloo). Every
process reads the same data stream and places only its own rows of each batch.

Only the leader (process 0) talks to the syncer. Everything that must stay identical across the
processes goes through the island's own collectives, at points every process reaches in the same
order:

- start: the leader pulls the global fragments; `broadcast_one_to_all` gives them to the rest;
- every step boundary: the leader decides which merged fragments are applied now (a vector of
  versions, broadcast), then broadcasts their values; every process applies the same ones;
- a push: every process joins a `process_allgather` of the fragment (the leader needs the host
  values; the others discard them); the leader's background thread pushes and pulls.

So after each merge the processes hold identical parameters. The schedule itself must be known
to every process without asking the syncer, which rules out dynamic local updates (they follow
the fastest learner's step time, which only the leader hears).

Failures: losing any process takes the whole island down. A peer blocked in a collective with a
dead process gets an error, and JAX's coordination service aborts every task of the island once
a heartbeat is missed for `heartbeat_timeout_s` (`decoupled.island_heartbeat_s`). The island
is then restarted as a whole (all P processes, by the launcher, Kubernetes or the operator) and
rejoins like a restarted single-process learner: it registers again and takes the current
global fragments.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from decoupled_diloco.config import ConfigError, ExperimentConfig
from decoupled_diloco.core.fragments import TensorSpec
from decoupled_diloco.learner.bridge import Anchors
from decoupled_diloco.learner.learner import Learner
from decoupled_diloco.learner.round_trip import Inbound
from decoupled_diloco.learner.sync import DecoupledSync

# Seconds without a heartbeat before the coordination service declares a process dead and
# aborts the island's other processes (JAX's default is 100 s, slow for a failure test).
DEFAULT_HEARTBEAT_TIMEOUT_S = 10


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in its island.

    Attributes:
      coordinator: HOST:PORT of the island's JAX coordination service (run by process 0).
      num_processes: P, the island's processes.
      process_id: this process, 0..P-1; 0 is the leader.
    """

    coordinator: str
    num_processes: int
    process_id: int

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"--num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"--process_id must be in [0, {self.num_processes}), got {self.process_id}"
            )
        if self.num_processes > 1:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"--coordinator must be HOST:PORT of the island's process 0, "
                    f"got {self.coordinator!r}"
                )

    @property
    def is_leader(self) -> bool:
        """Whether this process talks to the syncer."""
        return self.process_id == 0


def local_device_count(total_devices: int, num_processes: int) -> int:
    """Devices each process contributes to an island mesh of `total_devices`.

    Raises:
      ValueError: the mesh does not split evenly over the processes.
    """
    if total_devices % num_processes:
        raise ValueError(
            f"the island's mesh has {total_devices} devices, which does not split evenly over "
            f"{num_processes} processes"
        )
    return total_devices // num_processes


def initialize(group: ProcessGroup, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
    """Joins this process to its island's JAX runtime; a no-op for a one-process island.

    Must run before JAX initialises a backend. Selects gloo for cross-process collectives on
    CPU (the setting only affects the CPU backend, so it is harmless on GPU/TPU).
    """
    if group.num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=group.coordinator,
        num_processes=group.num_processes,
        process_id=group.process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )


def put_global(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host value every process holds in full.

    Each process fills only its addressable shards; correct in a single process too.
    """
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(leaves: Sequence[jax.Array]) -> list[np.ndarray]:
    """Full host copies of global arrays. A collective: every process must call it."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return [np.asarray(x) for x in jax.device_get(list(leaves))]
    gathered = multihost_utils.process_allgather(list(leaves), tiled=True)
    return [np.asarray(x) for x in gathered]


def broadcast(tree: Any) -> Any:
    """Process 0's value of a host pytree, on every process. A collective."""
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


class CollectiveBridge:
    """A `HostBridge` whose moves are collectives over the island; only the leader talks.

    Every call is a collective the island's processes make at the same point of their step
    loops (see the module doc).

    Args:
      group: this process's place in the island.
    """

    # Only the leader hears a refusal, and acting on it would take a collective at the same
    # step on every process: a push refused as late is not rebased (its data is handed out
    # again) and one refused as covered does not restart its count (its steps can then reach
    # the global model with the next push: a lease handed again while the island was slow,
    # not dead, which the ledger cannot see). The lead's phase would be heard at different
    # times by the processes: not taken.
    alone = False

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.talks = group.is_leader
        # (step, fragment, version, digest of this process's shards) after each merge: equal
        # across the processes of an island whose processes differ only along the data axis.
        self.merge_digests: list[list[Any]] = []
        self.busy: set[int] = set()  # fragments whose round trip is under way, agreed

    def to_host(self, leaves: Sequence[jax.Array]) -> list[np.ndarray]:
        """Host copies of global arrays (an all-gather)."""
        return to_host(leaves)

    def place(self, value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """A host value as a global array (each process places its own shards)."""
        return put_global(value, sharding)

    def join(self, pull: Callable[[], Anchors], partition: list[list[TensorSpec]]) -> Anchors:
        """The leader connects and pulls; every process receives the global fragments."""
        # The island's collectives connect first, while the links are idle: the leader's pull
        # can fill its link for minutes, and gloo's connects behind it (their SYNs dropped by a
        # full queue) time out ("Connect timeout", seen at 0.5 Mbit/s between sites).
        broadcast(np.int32(0))
        if self.group.is_leader:
            anchors, versions = pull()
        else:
            anchors = [[np.zeros(s.shape, s.dtype) for s in frag] for frag in partition]
            versions = [0] * len(partition)
        anchors, versions = broadcast((anchors, np.asarray(versions, np.int32)))
        return [[np.asarray(x) for x in frag] for frag in anchors], [int(v) for v in versions]

    def take_ready(
        self,
        take: Callable[[], dict[int, Inbound]],
        in_flight: Callable[[int], bool],
        partition: list[list[TensorSpec]],
    ) -> dict[int, Inbound]:
        """The leader's ready merges, agreed by every process (two broadcasts)."""
        num = len(partition)
        ready = take() if self.group.is_leader else {}
        # Row 0: the version applied now per fragment (-1: none); row 1: the push it answers;
        # row 2: 1 where its round trip is under way (the next step holds its push if due).
        agreed = np.full((3, num), -1, np.int32)
        for p, inbound in ready.items():
            agreed[:2, p] = inbound.version, inbound.pushed_at
        if self.group.is_leader:
            agreed[2] = [in_flight(p) for p in range(num)]
        versions, pushed_at, busy = broadcast(agreed)
        self.busy = {p for p in range(num) if busy[p] > 0}
        chosen = [p for p in range(num) if versions[p] >= 0]
        if not chosen:
            return {}
        values = [
            ready[p].values
            if self.group.is_leader
            else [np.zeros(s.shape, s.dtype) for s in partition[p]]
            for p in chosen
        ]
        values = broadcast(values)
        return {
            p: Inbound(int(versions[p]), [np.asarray(x) for x in vals], 0, int(pushed_at[p]))
            for p, vals in zip(chosen, values, strict=True)
        }

    def under_way(self, p: int, in_flight: Callable[[int], bool]) -> bool:
        """As the leader saw it at the last step boundary (`take_ready`).

        Every process of the island holds or pushes the same fragments at the same step.
        """
        del in_flight
        return p in self.busy

    def merged(self, step: int, p: int, version: int, leaves: list[jax.Array]) -> None:
        """Records the digest of this process's shards of the merged fragment."""
        self.merge_digests.append([step, p, version, shard_digest(leaves)])


class MultihostLearner(Learner):
    """A learner whose island spans every process of this JAX runtime.

    Args:
      config: the experiment; `dynamic_local_updates` must be off.
      learner_id: this island's index at the syncer.
      address: HOST:PORT of the syncer (used by the leader only).
      group: this process's place in the island.
      mesh_shape: (`data`, `model`) over all the island's devices (`jax.device_count()`).
      slowdown, token, timeline, controls: as for `Learner` (only the leader's timeline).
      workdir: as for `Learner`; with checkpoints on, every process of the island must see the
        same directory (shared storage across hosts): Orbax writes the checkpoint collectively.

    Raises:
      ConfigError: dynamic local updates are on (the step schedule would diverge).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        learner_id: int,
        address: str,
        group: ProcessGroup,
        mesh_shape: tuple[int, int] | None = None,
        slowdown: float = 1.0,
        token: str = "",
        workdir: str | pathlib.Path | None = None,
        timeline: Any = None,
        controls: Any = None,
    ):
        if config.decoupled.dynamic_local_updates:
            raise ConfigError(
                "decoupled.dynamic_local_updates is not supported on multi-process islands: "
                "only the leader hears the fastest learner's step time"
            )
        if group.num_processes != jax.process_count():
            raise ValueError(
                f"--num_processes={group.num_processes} but this JAX runtime has "
                f"{jax.process_count()} processes (call multihost.initialize first)"
            )
        self.group = group
        super().__init__(
            config,
            learner_id,
            address,
            devices=jax.devices(),
            mesh_shape=mesh_shape,
            slowdown=slowdown,
            token=token,
            workdir=workdir,
            timeline=timeline if group.is_leader else None,  # the leader's is the island's
            controls=controls,
        )
        if self.checkpoints is not None:
            # A restart must skip the same batches on every process: the leader's journal rules.
            self.checkpoints.journal = _AgreedJournal(self.checkpoints.journal, group.is_leader)

    lease_ahead = False  # its processes ask together (a broadcast), at each lease's end
    settle_s = 0.0  # and poll their pause once per ask, together

    def _make_sync(self, client: Any, **extra: Any) -> DecoupledSync:
        return super()._make_sync(client, bridge=CollectiveBridge(self.group), **extra)

    def _ask(self, flushed: bool) -> Any:
        """The leader asks for the island; every process trains the same lease."""
        statuses = ("granted", "wait", "done", "off")
        num = len(self.sync.partition)
        row = np.zeros(5 + num, np.int64)
        if self.group.is_leader:
            g = super()._ask(flushed)
            row[:5] = statuses.index(g.status), g.lease, g.begin, g.end, g.num_shards
            row[5 : 5 + len(g.covered)] = list(g.covered)
        row = [int(x) for x in np.asarray(broadcast(row))]
        return types.SimpleNamespace(
            status=statuses[row[0]],
            lease=row[1],
            begin=row[2],
            end=row[3],
            num_shards=row[4],
            covered=row[5:] if statuses[row[0]] == "granted" else [],
        )

    def _batch(self, batch: Any) -> Any:
        # Every process reads the same stream; each places only its own rows.
        return jax.tree.map(lambda x: put_global(x, self.island.batch_sharding), batch)

    def run(self) -> dict[str, Any]:
        """Trains like `Learner.run`; the summary adds this process's place and merge digests."""
        summary = super().run()
        summary.update(
            process_id=self.group.process_id,
            num_processes=self.group.num_processes,
            merge_digests=self.sync.bridge.merge_digests,
        )
        return summary


class _AgreedJournal:
    """A data journal that only the leader writes and whose reading every process shares."""

    def __init__(self, journal: Any, is_leader: bool):
        self._journal, self._leader = journal, is_leader

    def read(self) -> int:
        return int(broadcast(np.int32(self._journal.read() if self._leader else 0)))

    def write(self, position: int) -> None:
        if self._leader:
            self._journal.write(position)

    def close(self) -> None:
        self._journal.close()


def shard_digest(leaves: Sequence[jax.Array]) -> str:
    """CRC32 of the shards of `leaves` that this process holds, one per distinct index."""
    crc = 0
    for leaf in leaves:
        seen = {}
        for shard in leaf.addressable_shards:
            key = str([(s.start, s.stop) for s in shard.index])
            if key not in seen:
                seen[key] = np.ascontiguousarray(np.asarray(shard.data)).tobytes()
        for key in sorted(seen):
            crc = zlib.crc32(key.encode() + seen[key], crc)
    return f"{crc:08x}"
