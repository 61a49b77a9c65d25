"""The learner-side client of the syncer: deadlines, retries with backoff, chunked streams.

Control calls have fixed deadlines. A push or pull may take as long as its bytes need on a slow
link: it is cut once it moves nothing for `rpc_timeout_s` (a pull's first chunk may also wait
`wait_s` for the merge), with a deadline of `rpc_timeout_s` per chunk behind that. So a fragment
that takes minutes to cross a WAN link arrives, as long as each chunk crosses it within
`rpc_timeout_s` and the syncer's `stream_idle_s` (`config.checks` holds `chunk_bytes` to that
where the link's rate is known, `decoupled.wan_mbit`), and a stalled transfer still ends.
Pushes, and the bodies of pulls, cross the data connection `max_transfers` at a time each way
(default one): streams at once share its rate, and behind a slow link gRPC shared it so
unevenly that some moved nothing for longer than those bounds (`tools/wan_streams.py`).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import syncer_pb2_grpc as pb_grpc
from decoupled_diloco.comm import wire
from decoupled_diloco.comm.retry import Backoff, retry
from decoupled_diloco.config import SyncerConfig
from decoupled_diloco.core import host
from decoupled_diloco.core.fragments import TensorSpec

T = TypeVar("T")


class Stalled(grpc.RpcError):
    """A push or pull that moved nothing for too long; retried like a deadline."""

    def __init__(self, what: str, idle_s: float):
        super().__init__(f"{what}: nothing moved for {idle_s:g} s")
        self._details = f"{what}: nothing moved for {idle_s:g} s (cut by the client)"

    def code(self) -> grpc.StatusCode:
        """DEADLINE_EXCEEDED: retried (`comm.retry`)."""
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        """What stalled, and for how long."""
        return self._details


class _Watch:
    """Cancels a streaming call once it has moved nothing for `idle_s` (`first_s` more at first).

    `guard(call)` starts watching; `moved()` on every chunk (`handed(nbytes)` once gRPC has
    taken a pushed one); `sent()` once a push's last chunk is with gRPC; `close()` when the
    call is over.
    """

    def __init__(self, idle_s: float, first_s: float = 0.0):
        self.idle_s = idle_s
        self._deadline = time.monotonic() + idle_s + first_s  # (one attribute: no torn reads)
        self._end = math.inf  # (`limit`)
        self.stalled, self._done = False, threading.Event()
        self._marks: list[tuple[float, int]] = []  # (time, bytes gRPC had taken by then)

    def guard(self, call: Any) -> None:
        if hasattr(call, "cancel"):  # (a stream some interceptor wrapped may have none)
            threading.Thread(target=self._run, args=(call,), daemon=True, name="dd-watch").start()

    def moved(self) -> None:
        self._deadline = time.monotonic() + self.idle_s

    def hold(self) -> None:
        """Stops counting idle time (the call waits for its turn, `SyncerClient` gates)."""
        self._deadline = math.inf

    def limit(self, seconds: float) -> None:
        """Cancels the call `seconds` from now, moving or not (a deadline set mid-call)."""
        self._end = time.monotonic() + seconds

    def handed(self, nbytes: int) -> None:
        """Records that gRPC took a chunk of `nbytes` (it asks for the next once one is sent)."""
        self.moved()
        self._marks.append((time.monotonic(), (self._marks[-1][1] if self._marks else 0) + nbytes))

    def sent(self) -> None:
        """The last chunk is with gRPC: the reply may wait for what is still queued to cross.

        Without a pace to go by (gRPC took the whole stream at once) only the call's own
        deadline (`transfer_deadline_s`) bounds the wait.
        """
        now = time.monotonic()
        queued = queued_s(self._marks[:-1], now)  # (the last chunk is the checksum alone)
        self._deadline = math.inf if queued is None else now + self.idle_s + queued

    def close(self) -> None:
        self._done.set()

    def _run(self, call: Any) -> None:
        while not self._done.wait(min(1.0, self.idle_s / 4)):
            if time.monotonic() > min(self._deadline, self._end):
                self.stalled = True
                call.cancel()
                return


PACED_GAP_S = 0.05  # a gap between chunks taken at least this long: gRPC waited for the link


def queued_s(marks: list[tuple[float, int]], now: float) -> float | None:
    """How long the bytes gRPC has taken, but the link not yet carried, may take to cross.

    gRPC takes a stream's chunks as fast as it can buffer them (its flow-control window and
    the kernel's socket buffer: about a megabyte), then one as each crosses the link. The
    slowest of the last three gaps between chunks taken is the link's pace; what that pace
    could not have carried since the first chunk is still queued (measured: at 0.153 Mbit/s
    the last of a 2.2 MB push in 64 KiB chunks was taken after 55 s, with ~1.1 MB still to
    cross: 57 s more).

    Args:
      marks: per data chunk taken, (time, bytes taken by then).
      now: when the last chunk was taken.

    Returns:
      Seconds; None when no gap shows the link's pace (gRPC took the stream at once).
    """
    pairs = zip(marks[:-1], marks[1:], strict=True)
    gaps = [(b1 - b0, t1 - t0) for (t0, b0), (t1, b1) in pairs][-3:]
    paced = [nbytes / seconds for nbytes, seconds in gaps if seconds >= PACED_GAP_S]
    if not paced:
        return None
    rate = min(paced)
    return max(marks[-1][1] - rate * (now - marks[0][0]), 0.0) / rate


def transfer_deadline_s(nbytes: int, config: SyncerConfig, wait_s: float = 0.0) -> float:
    """The most a push or pull of `nbytes` may take, as a whole: the backstop behind `_Watch`.

    `wait_s` (a pull's wait for its merge), then `rpc_timeout_s` for each chunk and one more
    for the reply.
    """
    chunks = -(-max(nbytes, 1) // config.chunk_bytes)
    return wait_s + config.rpc_timeout_s * (1 + chunks)


class SyncerClient:
    """Calls on one syncer, bounded in time and retried with jittered exponential backoff.

    Args:
      address: HOST:PORT of the syncer.
      config: transport settings (chunk size, deadlines, retries, TLS).
      token: the run token (default: from config or `DD_RUN_TOKEN`).
      link: an interceptor on the channel: under a fault schedule, the learner's degraded link
        (`faulty_link.DegradedLink`); None: the plain channel.
    """

    def __init__(
        self,
        address: str,
        config: SyncerConfig,
        token: str = "",
        link: grpc.UnaryUnaryClientInterceptor | None = None,
    ):
        self.address, self.config = address, config
        # Two connections: the data calls' bytes queue in their own TCP connection (on a slow
        # link, seconds to minutes of them), so that heartbeats and other control calls never
        # wait behind a fragment in transit (the syncer would count a pushing learner lost).
        self.channel = wire.make_channel(address, config)
        self.control_channel = wire.make_channel(address, config, own_connection=True)
        if link is not None:
            self.channel = grpc.intercept_channel(self.channel, link)
            self.control_channel = grpc.intercept_channel(self.control_channel, link)
        self.stub = pb_grpc.SyncerStub(self.control_channel)
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
        # At most `max_transfers` pushes, and as many pulls' bodies, cross the data connection
        # at once (`SyncerConfig.max_transfers`); None: no bound.
        n = config.max_transfers
        self._uploads = threading.BoundedSemaphore(n) if n else None
        self._downloads = threading.BoundedSemaphore(n) if n else None
        # Per learner id, the incarnation its last registration got (stamped on its pushes).
        self.incarnations: dict[int, int] = {}
        # Traffic of the data calls (encoded chunk bytes, headers included), all threads
        # together; `last_bytes()` is the calling thread's last push or pull.
        self.bytes_sent = self.bytes_received = 0
        self._traffic_lock = threading.Lock()
        self._local = threading.local()

    def close(self) -> None:
        """Closes the connections."""
        self.channel.close()
        self.control_channel.close()

    def _call(self, fn: Callable[[], T], retries: int | None = None) -> T:
        """`fn()` with up to `retries` (default `config.retries`) retries (`comm.retry`)."""
        retries = self.config.retries if retries is None else retries
        return retry(fn, attempts=retries + 1, backoff=Backoff(first_s=0.1), on_retry=self._retried)

    def _retried(self) -> None:
        self.retries_done += 1

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the channel connects (the syncer may still be starting)."""
        deadline = time.monotonic() + timeout_s
        for channel in (self.control_channel, self.channel):
            grpc.channel_ready_future(channel).result(timeout=max(deadline - time.monotonic(), 0))

    def register(self, learner_id: int, fingerprint: str, mesh: str = "") -> pb.RegisterReply:
        """Registers this learner; refused (FAILED_PRECONDITION) if the model differs."""
        request = pb.RegisterRequest(learner_id=learner_id, fingerprint=fingerprint, mesh=mesh)
        reply = self._call(
            lambda: self.stub.Register(
                request, timeout=self.config.rpc_timeout_s, metadata=self.metadata
            )
        )
        self.incarnations[learner_id] = reply.incarnation
        return reply

    def heartbeat(self, **fields: Any) -> pb.HeartbeatReply:
        """Reports progress (fields of `HeartbeatRequest`); one quick try, no retries."""
        request = pb.HeartbeatRequest(**fields)
        return self._call(
            lambda: self.stub.Heartbeat(request, timeout=5.0, metadata=self.metadata), retries=0
        )

    def lease(
        self, learner_id: int, flushed: bool = False, retries: int | None = None
    ) -> pb.LeaseReply:
        """Asks for a lease of training data (`syncer.ledger`); `retries` as for every call."""
        request = pb.LeaseRequest(learner_id=learner_id, flushed=flushed)
        return self._call(
            lambda: self.stub.Lease(
                request, timeout=self.config.rpc_timeout_s, metadata=self.metadata
            ),
            retries,
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
        self, header: pb.PushHeader, arrays: Sequence[np.ndarray], sent: list[int] | None = None
    ) -> Callable[[], Iterator[bytes]]:
        """A factory of the encoded chunk stream (a retry needs a fresh iterator).

        `sent[0]` (if given) adds up the bytes streamed; gRPC consumes the stream in its own
        thread, so the count cannot be thread-local.
        """

        def stream() -> Iterator[bytes]:
            crc, i = 0, 0  # the checksum is computed as the chunks go, and sent last
            for i, piece in enumerate(wire.chunk_arrays(arrays, self.config.chunk_bytes)):
                crc = zlib.crc32(piece, crc)
                if i == 0:
                    chunk = pb.PushChunk(header=header, data=piece).SerializeToString()
                else:
                    chunk = wire.push_data_chunk(i, piece)
                self._count(sent=len(chunk))
                if sent is not None:
                    sent[0] += len(chunk)
                yield chunk
            yield pb.PushChunk(seq=i + 1, payload_crc32=crc).SerializeToString()

        return stream

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._traffic_lock:
            self.bytes_sent += sent
            self.bytes_received += received
        self._local.bytes = getattr(self._local, "bytes", 0) + received

    def last_bytes(self) -> int:
        """Bytes the calling thread's last `push` or `pull` moved (retries included)."""
        return getattr(self._local, "last", 0)

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
        tensors: Sequence[pb.TensorHeader] | None = None,
        retries: int | None = None,
        data: Sequence[Sequence[int]] = (),
    ) -> pb.PushReply:
        """Streams one fragment's outer gradient; retried safely (idempotent per round).

        Without `tensors`, `arrays` are the raw tensors (numpy, or lazy ones such as
        `core.outer.Difference`: see `wire.chunk_arrays`); with them (`wire.headers` of a codec),
        `arrays` are the encoded sections in wire order (`wire.encoded_arrays`). `retries`:
        as for every call (a caller with its own retry loop passes 0). `data`: the leased
        batches ([lease, begin, end)) the outer gradient trained on (`syncer.ledger`).
        """
        header = pb.PushHeader(
            learner_id=learner_id,
            fragment=fragment,
            round=round,
            base_version=base_version,
            steps=steps,
            tokens=tokens,
            tensors=wire.headers(specs) if tensors is None else tensors,
            total_bytes=sum(a.nbytes for a in arrays),  # (never materialised here)
            incarnation=self.incarnations.get(learner_id, 0),
            data=[pb.DataRange(lease=k, begin=b, end=e) for k, b, e in data],
        )
        sent = [0]
        stream = self.push_chunks(header, arrays, sent)
        idle_s = self.config.rpc_timeout_s

        deadline = transfer_deadline_s(header.total_bytes, self.config)

        def call() -> pb.PushReply:
            # (the stream starts, and its deadline, with its turn)
            with self._uploads or contextlib.nullcontext():
                return attempt()

        def attempt() -> pb.PushReply:
            watch = _Watch(idle_s)

            def watched() -> Iterator[bytes]:
                for chunk in stream():  # (gRPC asks for the next once the last one is sent)
                    watch.moved()
                    yield chunk
                    watch.handed(len(chunk))
                watch.sent()  # (the reply gets a whole `idle_s` after the queue has crossed)

            try:
                future = self._push.future(watched(), timeout=deadline, metadata=self.metadata)
                watch.guard(future)
                return future.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                if watch.stalled:
                    raise Stalled(f"push of fragment {fragment}", idle_s) from None
                raise
            finally:
                watch.close()

        try:
            return self._call(call, retries)
        finally:
            self._local.last = sent[0]

    def pull(
        self,
        learner_id: int,
        fragment: int,
        min_version: int,
        wait_s: float,
        have: tuple[int, Sequence[np.ndarray]] | None = None,
        retries: int | None = None,
    ) -> tuple[int, list[np.ndarray]]:
        """The fragment once its version reaches `min_version`; (-1, []) if not within `wait_s`.

        `have` = (version, values) of the copy this learner holds: with a compressed downlink
        the syncer may send the difference from it, which is added here. Either way the
        result is the full fragment. `retries`: as for `push`.
        """
        request = pb.PullRequest(
            learner_id=learner_id,
            fragment=fragment,
            min_version=min_version,
            wait_s=wait_s,
            has_copy=have is not None,
            have_version=have[0] if have is not None else 0,
        )

        idle_s = self.config.rpc_timeout_s

        # Without a copy its size is not known here: the watch alone bounds it.
        known = sum(np.asarray(a).nbytes for a in have[1]) if have is not None else 0
        deadline = transfer_deadline_s(known, self.config, wait_s) if known else None
        if self._downloads is not None:  # the body's deadline starts with its turn: `receive`
            deadline = None

        def call() -> tuple[int, list[np.ndarray]]:
            watch = _Watch(idle_s, first_s=wait_s)
            try:
                stream = self._pull(request, timeout=deadline, metadata=self.metadata)
                watch.guard(stream)
                return receive(stream, watch)
            except grpc.RpcError:
                if watch.stalled:
                    raise Stalled(f"pull of fragment {fragment}", idle_s) from None
                raise
            finally:
                watch.close()

        def receive(stream: Any, watch: _Watch) -> tuple[int, list[np.ndarray]]:
            raw = next(stream)
            watch.moved()
            self._count(received=len(raw))
            first = pb.FragmentChunk.FromString(raw)
            if first.version < 0:
                return -1, []
            specs = [
                TensorSpec(i, t.name, tuple(t.shape), t.dtype) for i, t in enumerate(first.tensors)
            ]
            # Each header's size is checked against its shape and codec, so the buffer below
            # is the fragment's own size.
            expected = wire.check_headers(first.tensors, specs)
            if first.total_bytes != expected:
                raise wire.PayloadError(
                    f"fragment {fragment}: reply of {first.total_bytes} bytes, its tensors "
                    f"need {expected}"
                )
            # Each chunk is copied into place as it arrives (gRPC receives the next meanwhile),
            # in an aligned buffer: on a CPU, tensors that start on a 64-byte boundary in it
            # (all of them when every tensor's byte size is a multiple of 64) are placed
            # without another copy.
            payload, at = memoryview(host.aligned_zeros(expected, np.uint8)), len(first.data)
            if at > expected:
                raise wire.PayloadError(f"fragment {fragment}: more than {expected} bytes")
            payload[:at] = first.data
            # The body waits for its turn (its idle time not counted meanwhile: gRPC holds a
            # flow-control window of it, then the syncer waits), and is bounded from then.
            watch.hold()
            with self._downloads or contextlib.nullcontext():
                watch.moved()
                if self._downloads is not None:
                    watch.limit(transfer_deadline_s(expected, self.config))
                for raw in stream:
                    watch.moved()
                    self._count(received=len(raw))
                    view = wire.parse_data_chunk(wire.PULL_DATA_TAG, raw)
                    data = view if view is not None else pb.FragmentChunk.FromString(raw).data
                    if at + len(data) > expected:
                        raise wire.PayloadError(f"fragment {fragment}: more than {expected} bytes")
                    payload[at : at + len(data)] = data
                    at += len(data)
            # The syncer validated every push and merges finite values: no second scan here.
            values = wire.decode_payload(payload[:at], first.tensors, specs, False)
            if first.delta:
                if have is None or first.base_version != have[0]:
                    raise wire.PayloadError(
                        f"fragment {fragment}: a difference from version {first.base_version}, "
                        f"but this learner holds {None if have is None else have[0]}"
                    )
                values = [
                    (np.asarray(h, np.float32) + d).astype(h.dtype)
                    for h, d in zip(have[1], values, strict=True)
                ]
            return first.version, values

        self._local.bytes = 0
        try:
            return self._call(call, retries)
        finally:
            self._local.last = self._local.bytes
