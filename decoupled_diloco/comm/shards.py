"""Syncer shards seen as one syncer: fragment p lives on shard p % S.

With `decoupled.syncer.shards` = S, S syncer processes each own the fragments p with
p % S == s, keep their own checkpoints and fail alone. A learner holds one client per shard:
pushes and pulls of fragment p go to its shard; registration and heartbeats go to every shard
(each shard needs the learner in its quorum and liveness); a shard that is down costs only its
own fragments. `ShardedClient` has the `SyncerClient` interface, so the learner, the launcher
and the status tool use either one unchanged; `syncer_client` picks one from an address list.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import grpc

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.config import SyncerConfig


def parse_addresses(address: str | Sequence[str]) -> list[str]:
    """`HOST:PORT[,HOST:PORT...]` (shard 0 first) as a list.

    Raises:
      ValueError: an empty list.
    """
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = [a.strip() for a in items if a.strip()]
    if not addresses:
        raise ValueError(f"no syncer address in {address!r} (expected HOST:PORT[,HOST:PORT...])")
    return addresses


def syncer_client(
    address: str | Sequence[str], config: SyncerConfig, token: str = "", link: Any = None
) -> SyncerClient | ShardedClient:
    """A client of one syncer, or of S shards when `address` lists S addresses.

    `link`: an interceptor on every channel (see `SyncerClient`).

    Raises:
      ValueError: the number of addresses is not `config.shards`.
    """
    addresses = parse_addresses(address)
    if len(addresses) != config.shards:
        raise ValueError(
            f"{len(addresses)} syncer address(es) {addresses} for "
            f"decoupled.syncer.shards={config.shards}: give one HOST:PORT per shard, shard 0 first"
        )
    if len(addresses) == 1:
        return SyncerClient(addresses[0], config, token, link)
    return ShardedClient(addresses, config, token, link)


class ShardedClient:
    """One `SyncerClient` per shard behind the `SyncerClient` interface.

    Args:
      addresses: HOST:PORT of every shard, shard 0 first.
      config: transport settings.
      token: the run token.
      link: an interceptor on every shard's channel (see `SyncerClient`).
    """

    def __init__(
        self, addresses: Sequence[str], config: SyncerConfig, token: str = "", link: Any = None
    ):
        self.config = config
        self.clients = [SyncerClient(a, config, token, link) for a in addresses]
        self.address = ",".join(addresses)
        self._local = threading.local()

    def shard_of(self, fragment: int) -> int:
        """The shard that owns `fragment`."""
        return fragment % len(self.clients)

    def _for(self, fragment: int) -> SyncerClient:
        client = self.clients[self.shard_of(fragment)]
        self._local.last = client
        return client

    # The SyncerClient interface -------------------------------------------------------------

    @property
    def retries_done(self) -> int:  # noqa: D102
        return sum(c.retries_done for c in self.clients)

    @property
    def bytes_sent(self) -> int:  # noqa: D102
        return sum(getattr(c, "bytes_sent", 0) for c in self.clients)

    @property
    def bytes_received(self) -> int:  # noqa: D102
        return sum(getattr(c, "bytes_received", 0) for c in self.clients)

    def last_bytes(self) -> int:
        """Bytes of the calling thread's last push or pull (on whichever shard it went to)."""
        last = getattr(self._local, "last", None)
        return last.last_bytes() if last is not None else 0

    def close(self) -> None:
        """Closes every shard's channel."""
        for client in self.clients:
            client.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until every shard accepts connections."""
        for client in self.clients:
            client.wait_ready(timeout_s)

    def _owned(self, replies: Sequence[Any]) -> list[int]:
        """Each fragment's version from its own shard's reply."""
        num = max((len(r.versions) for r in replies), default=0)
        return [replies[self.shard_of(p)].versions[p] for p in range(num)]

    def register(self, learner_id: int, fingerprint: str, mesh: str = "") -> pb.RegisterReply:
        """Registers with every shard; versions come from each fragment's shard."""
        replies = [c.register(learner_id, fingerprint, mesh) for c in self.clients]
        return pb.RegisterReply(
            num_fragments=replies[0].num_fragments, versions=self._owned(replies)
        )

    def heartbeat(self, **fields: Any) -> pb.HeartbeatReply:
        """Reports to every shard; a shard that is down is skipped (raises if all are)."""
        replies: list[Any] = []
        failure = None
        for client in self.clients:
            try:
                replies.append(client.heartbeat(**fields))
            except grpc.RpcError as error:
                failure = failure or error
                replies.append(None)
        live = [r for r in replies if r is not None]
        if not live:
            raise failure
        times = [r.fastest_step_time_s for r in live if r.fastest_step_time_s > 0]
        versions = [
            r.versions[p]
            for p in range(len(live[0].versions))
            if (r := replies[self.shard_of(p)]) is not None
        ]
        return pb.HeartbeatReply(versions=versions, fastest_step_time_s=min(times, default=0.0))

    def status(self) -> dict[str, Any]:
        """Every shard's status combined; fragments come from their shards.

        A shard that does not answer is listed as down in `shards` (its fragments show
        `"version": None`); raises only if no shard answers.
        """
        statuses, failure = [], None
        for client in self.clients:
            try:
                statuses.append(client.status())
            except grpc.RpcError as error:
                failure = failure or error
                statuses.append(None)
        up = [s for s in statuses if s is not None]
        if not up:
            raise failure
        return combine(statuses, [c.address for c in self.clients])

    def lease(self, learner_id: int, flushed: bool = False, **kwargs: Any) -> pb.LeaseReply:
        """Data leases are shard 0's (they need one shard: `config.data_leases`)."""
        return self.clients[0].lease(learner_id, flushed, **kwargs)

    def push(self, *, fragment: int, **fields: Any) -> pb.PushReply:
        """Pushes to the shard that owns `fragment`."""
        return self._for(fragment).push(fragment=fragment, **fields)

    def pull(
        self, learner_id: int, fragment: int, min_version: int, wait_s: float, **kwargs: Any
    ) -> tuple[int, Any]:
        """Pulls from the shard that owns `fragment`."""
        return self._for(fragment).pull(learner_id, fragment, min_version, wait_s, **kwargs)


def combine(statuses: Sequence[dict[str, Any] | None], addresses: Sequence[str]) -> dict[str, Any]:
    """One status from the shards' (None: that shard did not answer)."""
    shards = len(statuses)
    up = [s for s in statuses if s is not None]
    num = len(up[0]["fragments"])
    fragments = []
    for p in range(num):
        owner = statuses[p % shards]
        entry = (
            dict(owner["fragments"][p])
            if owner is not None
            else {"version": None, "merges": 0, "pending": [], "late_pushes": 0}
        )
        entry.update(shard=p % shards, owned=True)
        fragments.append(entry)
    versions = [f["version"] for f in fragments]
    learners: dict[str, Any] = {}
    for status in up:  # the freshest report of each learner
        for i, entry in status["learners"].items():
            held = learners.get(i)
            if held is None or entry["heartbeat_age_s"] < held["heartbeat_age_s"]:
                learners[i] = dict(entry)
    for entry in learners.values():  # staleness against each fragment's own shard
        entry["staleness"] = max(
            (v - h for v, h in zip(versions, entry["versions"], strict=False) if v is not None),
            default=0,
        )
    combined = dict(up[0])
    sizes = [sum(x) for x in zip(*(s["merge_sizes"] for s in up), strict=True)]
    combined.update(
        learners=learners,
        live=sorted({i for s in up for i in s["live"]}),
        fragments=fragments,
        merges=sum(s["merges"] for s in up),
        merge_sizes=sizes,
        merge_log=[x for s in up for x in s["merge_log"]],
        shards=[
            {"shard": i, "address": a, "up": s is not None}
            for i, (a, s) in enumerate(zip(addresses, statuses, strict=True))
        ],
    )
    return combined
