"""The learner-side client of the syncer: deadlines, retries with backoff, chunked streams."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import syncer_pb2_grpc as pb_grpc
from decoupled_diloco.comm import wire
from decoupled_diloco.config import SyncerConfig
from decoupled_diloco.fragments import TensorSpec

T = TypeVar("T")
# Worth retrying: the syncer may be restarting or busy. Everything else is a real refusal.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SyncerClient:
    """Calls on one syncer, each with a deadline and retried with jittered exponential backoff.

    Args:
      address: HOST:PORT of the syncer.
      config: transport settings (chunk size, deadlines, retries, TLS).
      token: the run token (default: from config or `DD_RUN_TOKEN`).
    """

    def __init__(self, address: str, config: SyncerConfig, token: str = ""):
        self.address, self.config = address, config
        self.channel = wire.make_channel(address, config)
        self.stub = pb_grpc.SyncerStub(self.channel)
        # The data calls move pre-encoded chunks (see `wire.data_chunk`): raw bytes both ways.
        self._push = self.channel.stream_unary(
            "/decoupled_diloco.Syncer/Push",
            request_serializer=None,
            response_deserializer=pb.PushReply.FromString,
        )
        self._pull = self.channel.unary_stream(
            "/decoupled_diloco.Syncer/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=None,
        )
        self.metadata = ((wire.TOKEN_HEADER, token or wire.run_token(config)),)
        self.retries_done = 0

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def _call(self, fn: Callable[[], T], retries: int | None = None) -> T:
        retries = self.config.retries if retries is None else retries
        delay = 0.1
        for attempt in range(retries + 1):
            try:
                return fn()
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE or attempt == retries:
                    raise
                self.retries_done += 1
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the channel connects (the syncer may still be starting)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def register(self, learner_id: int, fingerprint: str, mesh: str = "") -> pb.RegisterReply:
        """Registers this learner; refused (FAILED_PRECONDITION) if the model differs."""
        request = pb.RegisterRequest(learner_id=learner_id, fingerprint=fingerprint, mesh=mesh)
        return self._call(
            lambda: self.stub.Register(
                request, timeout=self.config.rpc_timeout_s, metadata=self.metadata
            )
        )

    def heartbeat(self, **fields: Any) -> pb.HeartbeatReply:
        """Reports progress (fields of `HeartbeatRequest`); one quick try, no retries."""
        request = pb.HeartbeatRequest(**fields)
        return self._call(
            lambda: self.stub.Heartbeat(request, timeout=5.0, metadata=self.metadata), retries=0
        )

    def status(self) -> dict[str, Any]:
        """The syncer's status as a dict (see `SyncerState.status`)."""
        reply = self._call(
            lambda: self.stub.Status(
                pb.StatusRequest(), timeout=self.config.rpc_timeout_s, metadata=self.metadata
            )
        )
        return json.loads(reply.json)

    def push_chunks(
        self, header: pb.PushHeader, arrays: Sequence[np.ndarray]
    ) -> Callable[[], Iterator[bytes]]:
        """A factory of the encoded chunk stream (a retry needs a fresh iterator)."""

        def stream() -> Iterator[bytes]:
            for i, piece in enumerate(wire.chunk_arrays(arrays, self.config.chunk_bytes)):
                if i == 0:
                    yield pb.PushChunk(header=header, data=piece).SerializeToString()
                else:
                    yield wire.data_chunk(wire.PUSH_DATA_TAG, piece)

        return stream

    def push(
        self,
        *,
        learner_id: int,
        fragment: int,
        round: int,
        base_version: int,
        steps: int,
        tokens: int,
        specs: Sequence[TensorSpec],
        arrays: Sequence[np.ndarray],
    ) -> pb.PushReply:
        """Streams one fragment's outer gradient; retried safely (idempotent per round)."""
        header = pb.PushHeader(
            learner_id=learner_id,
            fragment=fragment,
            round=round,
            base_version=base_version,
            steps=steps,
            tokens=tokens,
            tensors=wire.headers(specs),
            total_bytes=sum(np.asarray(a).nbytes for a in arrays),
        )
        stream = self.push_chunks(header, arrays)
        return self._call(
            lambda: self._push(stream(), timeout=self.config.rpc_timeout_s, metadata=self.metadata)
        )

    def pull(
        self, learner_id: int, fragment: int, min_version: int, wait_s: float
    ) -> tuple[int, list[np.ndarray]]:
        """The fragment once its version reaches `min_version`; (-1, []) if not within `wait_s`."""
        request = pb.PullRequest(
            learner_id=learner_id, fragment=fragment, min_version=min_version, wait_s=wait_s
        )

        def call() -> tuple[int, list[np.ndarray]]:
            stream = self._pull(
                request, timeout=wait_s + self.config.rpc_timeout_s, metadata=self.metadata
            )
            first = pb.FragmentChunk.FromString(next(stream))
            if first.version < 0:
                return -1, []
            pieces = [first.data]
            for raw in stream:
                view = wire.parse_data_chunk(wire.PULL_DATA_TAG, raw)
                pieces.append(view if view is not None else pb.FragmentChunk.FromString(raw).data)
            specs = [
                TensorSpec(i, t.name, tuple(t.shape), t.dtype) for i, t in enumerate(first.tensors)
            ]
            # The syncer validated every push and merges finite values: no second scan here.
            return first.version, wire.from_bytes(b"".join(pieces), specs, require_finite=False)

        return self._call(call)
