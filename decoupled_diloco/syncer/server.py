r"""The syncer process: a gRPC server around `SyncerState`.

  DD_RUN_TOKEN=secret python -m decoupled_diloco.syncer --port=50051 \
      --config=experiments/configs/tiny_lm.py --config.mode=decoupled

Every call must carry the run token (metadata `x-dd-run-token`), else UNAUTHENTICATED.
Register checks the model fingerprint; pushes are validated (fragment id, tensor names, shapes,
dtypes, byte counts, size limit, finite values) before anything touches the state, and a bad
one is refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED and a message.
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import pathlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import jax
import numpy as np

from decoupled_diloco import tasks
from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import syncer_pb2_grpc as pb_grpc
from decoupled_diloco.comm import wire
from decoupled_diloco.config import ExperimentConfig
from decoupled_diloco.core import compression
from decoupled_diloco.core import fragments as F
from decoupled_diloco.core.compression import Codec
from decoupled_diloco.syncer.downlink import Downlink
from decoupled_diloco.syncer.records import Push
from decoupled_diloco.syncer.state import SyncerState


@functools.lru_cache(maxsize=4)
def initial_fragments(config: ExperimentConfig) -> tuple[list[list[F.TensorSpec]], list[list]]:
    """The fragment cut of the model and every fragment's initial values (host arrays).

    From the task alone: its abstract parameter tree gives the cut, its initializer (the
    learners' seed, no mesh) version 0. Learners start from the syncer's values, whatever
    their meshes.
    """
    task = tasks.make_task(config)
    specs = F.tensor_specs(task.abstract_params())
    cut = F.partition(specs, config.decoupled.fragments)
    leaves = jax.tree.leaves(task.init_params(config.seed))
    return cut, [F.gather(leaves, frag) for frag in cut]


def pause_in_merge(spec: str) -> Callable[[], None]:
    """A `SyncerState.merge_hook` from `N:PATH`: the N-th merge writes PATH and stops for good.

    The merge has computed the new values but not installed them, and holds the state lock,
    so that a test can kill the syncer in the middle of a merge (`--debug_pause_in_merge`).
    """
    count, path = spec.split(":", 1)
    seen = [0]

    def hook() -> None:
        seen[0] += 1
        if seen[0] == int(count):
            pathlib.Path(path).write_text(str(os.getpid()))
            threading.Event().wait()

    return hook


class SyncerService(pb_grpc.SyncerServicer):
    """The RPC handlers: authentication and validation in front of `SyncerState`."""

    def __init__(self, state: SyncerState, token: str, fingerprint: str):
        self.state, self.token, self.fingerprint = state, token, fingerprint
        self.committer: Any = None  # set by `SyncerServer` when the state is durable
        self.syncer_config = state.config.decoupled.syncer
        # Encoded pull chunks per (fragment, version): encoded once, shared by every learner.
        self._encoded: dict[tuple[int, int], list[bytes]] = {}
        self._encode_lock = threading.Lock()
        z = state.config.compression
        # Compressed downlink: per-learner differences from the copy each one holds.
        lossy = z.downlink and z.scheme != "none"
        self.downlink = Downlink(compression.codec_for(z)) if lossy else None

    def _authorize(self, context: grpc.ServicerContext) -> None:
        got = dict(context.invocation_metadata()).get(wire.TOKEN_HEADER, "")
        if not hmac.compare_digest(got.encode(), self.token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong run token")

    def _fragment(self, p: int, context: grpc.ServicerContext) -> None:
        if not 0 <= p < len(self.state.fragments):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"fragment {p} does not exist (the model has {len(self.state.fragments)})",
            )
        if p not in self.state.owned:
            shards = self.state.config.decoupled.syncer.shards
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"fragment {p} belongs to syncer shard {p % shards} of {shards}, not this one",
            )

    def _durable(self, context: grpc.ServicerContext) -> None:
        """Waits until every change so far is committed (see `syncer.durability`)."""
        if not self.state.wait_committed(self.state.seq, self.syncer_config.rpc_timeout_s):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer could not commit its state")

    def _known(self, learner_id: int, context: grpc.ServicerContext) -> None:
        if learner_id not in self.state.learners:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"learner {learner_id}: register first"
            )

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext):  # noqa: D102
        self._authorize(context)
        if not 0 <= request.learner_id < self.state.config.num_learners:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"learner id {request.learner_id} is not in [0, {self.state.config.num_learners})",
            )
        if request.fingerprint != self.fingerprint:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"learner {request.learner_id}: model fingerprint {request.fingerprint} does not "
                f"match the syncer's {self.fingerprint} (different tree structure, shapes or "
                "dtypes: check config.model on both sides)",
            )
        versions = self.state.register(request.learner_id, request.mesh)
        self._durable(context)
        return pb.RegisterReply(num_fragments=len(versions), versions=versions)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext):  # noqa: D102
        self._authorize(context)
        self._known(request.learner_id, context)
        versions = self.state.heartbeat(
            request.learner_id,
            step=request.step,
            tokens=request.tokens,
            loss=request.loss,
            eval_loss=request.eval_loss,
            bytes_sent=request.bytes_sent,
            bytes_received=request.bytes_received,
            sync_rounds=request.sync_rounds,
            state=request.state or "training",
            versions=list(request.versions),
            blocked_s=request.blocked_s,
            step_time_s=request.step_time_s,
        )
        return pb.HeartbeatReply(
            versions=versions, fastest_step_time_s=self.state.fastest_step_time()
        )

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext):  # noqa: D102
        self._authorize(context)
        status = self.state.status()
        if self.committer is not None:  # durable syncer: log syncs and snapshots
            status["durability"] = self.committer.stats()
        return pb.StatusReply(json=json.dumps(status))

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext):  # noqa: D102
        self._authorize(context)
        invalid, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
        raw = next(request_iterator, None)
        first = pb.PushChunk.FromString(raw) if raw is not None else None
        if first is None or not first.HasField("header"):
            context.abort(invalid, "a push must start with a header")
        h = first.header
        self._fragment(h.fragment, context)
        self._known(h.learner_id, context)
        specs = self.state.fragments[h.fragment].specs
        limit = self.syncer_config.max_push_bytes
        try:
            expected = wire.check_headers(h.tensors, specs)
        except wire.PayloadError as error:
            context.abort(invalid, f"fragment {h.fragment}: {error}")
        if max(h.total_bytes, expected) > limit:
            context.abort(
                exhausted, f"push of {max(h.total_bytes, expected)} bytes > limit {limit}"
            )
        if h.total_bytes != expected:
            context.abort(invalid, f"header says {h.total_bytes} bytes, tensors need {expected}")
        if h.steps < 1 or h.tokens < 0:
            context.abort(
                invalid, f"counters must be steps >= 1, tokens >= 0: {h.steps}, {h.tokens}"
            )
        if h.base_version > self.state.fragments[h.fragment].published:
            context.abort(invalid, f"base version {h.base_version} is from the future")
        pieces, received = [first.data], len(first.data)
        for raw in request_iterator:
            data = wire.parse_data_chunk(wire.PUSH_DATA_TAG, raw)
            data = data if data is not None else pb.PushChunk.FromString(raw).data
            pieces.append(data)
            received += len(data)
            if received > limit:
                context.abort(exhausted, f"payload passed the {limit}-byte limit")
        try:  # decodes (and checks) every tensor before the state sees any of them
            delta = wire.decode_payload(b"".join(pieces), h.tensors, specs)
        except wire.PayloadError as error:
            context.abort(invalid, f"fragment {h.fragment}: {error}")
        result = self.state.push(
            Push(h.learner_id, h.fragment, h.round, h.base_version, h.steps, h.tokens, delta)
        )
        self._durable(context)  # acknowledged only once a restart cannot lose it
        return pb.PushReply(
            accepted=result.accepted,
            duplicate=result.duplicate,
            reason=result.reason,
            version=result.version,
        )

    def _payload(self, p: int, version: int, values: list[np.ndarray]) -> list[bytes]:
        """The chunks of one fragment version, cut once and shared by every learner's pull."""
        with self._encode_lock:
            key = (p, version)
            if key not in self._encoded:
                self._encoded = {k: v for k, v in self._encoded.items() if k[0] != p}
                chunk_bytes = self.syncer_config.chunk_bytes
                self._encoded[key] = list(wire.chunk_arrays(values, chunk_bytes))
                tail = self._encoded[key][1:]
                self._encoded[key][1:] = [wire.data_chunk(wire.PULL_DATA_TAG, c) for c in tail]
            return self._encoded[key]

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext):  # noqa: D102
        self._authorize(context)
        self._fragment(request.fragment, context)
        wait_s = min(max(request.wait_s, 0.0), self.syncer_config.rpc_timeout_s)
        version, values = self.state.wait_for(request.fragment, request.min_version, wait_s)
        if version < 0:
            yield pb.FragmentChunk(fragment=request.fragment, version=-1)
            return
        specs = self.state.fragments[request.fragment].specs
        if self.downlink is not None and request.learner_id >= 0:
            yield from self._compressed_pull(request, version, values, specs)
            self.state.record_sync_time(request.fragment, version, request.learner_id)
            return
        pieces = self._payload(request.fragment, version, values)
        total = sum(s.nbytes for s in specs)
        yield pb.FragmentChunk(
            fragment=request.fragment,
            version=version,
            tensors=wire.headers(specs),
            total_bytes=total,
            data=pieces[0],
        )
        yield from pieces[1:]  # already encoded data-only chunks
        self.state.record_sync_time(request.fragment, version, request.learner_id)

    def _compressed_pull(
        self, request: pb.PullRequest, version: int, values: list, specs: list
    ) -> Iterator[Any]:
        """A learner's pull with `compression.downlink`: the difference from its own copy."""
        base, payload = self.downlink.reply(
            request.learner_id,
            request.fragment,
            version,
            values,
            specs,
            request.have_version if request.has_copy else None,
        )
        codec = self.downlink.codec if base is not None else Codec("none")
        arrays = wire.encoded_arrays(payload, specs, codec) if base is not None else payload
        tensors = wire.headers(specs, codec)
        pieces = list(wire.chunk_arrays(arrays, self.syncer_config.chunk_bytes))
        yield pb.FragmentChunk(
            fragment=request.fragment,
            version=version,
            tensors=tensors,
            total_bytes=sum(h.payload_bytes for h in tensors),
            data=pieces[0],
            delta=base is not None,
            base_version=base or 0,
        )
        yield from (wire.data_chunk(wire.PULL_DATA_TAG, c) for c in pieces[1:])


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_service(service: SyncerService, server: grpc.Server) -> None:
    """Registers the handlers; the data calls take and give raw bytes (see `wire.data_chunk`).

    Mirrors the generated `add_SyncerServicer_to_server`, except that Push requests arrive
    unparsed and Pull responses may be pre-encoded bytes, which saves two copies per chunk.
    """
    handlers = {
        "Register": grpc.unary_unary_rpc_method_handler(
            service.Register, pb.RegisterRequest.FromString, _serialize
        ),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            service.Heartbeat, pb.HeartbeatRequest.FromString, _serialize
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            service.Status, pb.StatusRequest.FromString, _serialize
        ),
        "Push": grpc.stream_unary_rpc_method_handler(service.Push, None, _serialize),
        "Pull": grpc.unary_stream_rpc_method_handler(
            service.Pull, pb.PullRequest.FromString, _serialize
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("decoupled_diloco.Syncer", handlers),)
    )
    server.add_registered_method_handlers("decoupled_diloco.Syncer", handlers)


class SyncerServer:
    """A running syncer: the state, the gRPC server, and a thread closing rounds on time.

    Args:
      config: the experiment.
      host: interface to bind (127.0.0.1 for loopback, 0.0.0.0 for other hosts).
      port: port to bind; 0 picks a free one (see `.port`).
      token: the run token (default: from config or `DD_RUN_TOKEN`).
      shard: this shard's index; it owns the fragments p with p % `syncer.shards` == shard.
      checkpoint_dir: where this shard commits its state (see `durability`); it
        resumes from the newest readable commit there. None: in memory only.
      merge_hook: passed to `SyncerState` (tests: `pause_in_merge`).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        host: str = "",
        port: int = -1,
        token: str = "",
        shard: int = 0,
        checkpoint_dir: str | None = None,
        merge_hook: Callable[[], None] | None = None,
    ):
        s = config.decoupled.syncer
        if not 0 <= shard < s.shards:
            raise ValueError(f"--shard={shard} is not in [0, decoupled.syncer.shards={s.shards})")
        if s.tls_cert and not s.tls_key:  # learners need only the certificate; a syncer both
            raise ValueError(
                "config.decoupled.syncer.tls_key: a TLS syncer needs its private key "
                f"(tls_cert is {s.tls_cert!r})"
            )
        cut, values = initial_fragments(config)
        owned = [p for p in range(len(cut)) if p % s.shards == shard]
        self.shard = shard
        self.state = SyncerState(
            config,
            cut,
            values,
            owned=owned,
            is_mean_only=tasks.make_task(config).is_mean_only,
            merge_hook=merge_hook,
        )
        self.committer = self.restored_step = None
        if checkpoint_dir:
            from decoupled_diloco.syncer.durability import Committer

            self.committer = Committer(
                self.state, checkpoint_dir, config.checkpoint.max_to_keep, s.snapshot_s
            )
            self.restored_step = self.committer.restore()
        self.state.warm_up()
        self.fingerprint = F.fingerprint(sorted((x for f in cut for x in f), key=lambda x: x.index))
        self.service = SyncerService(self.state, token or wire.run_token(s), self.fingerprint)
        self.service.committer = self.committer
        self.server = grpc.server(
            # A pull holds its thread while it waits for a merge, and every learner may have one
            # per fragment in flight; pushes, heartbeats and status calls must still get a thread.
            futures.ThreadPoolExecutor(
                max_workers=config.num_learners * (config.decoupled.fragments + 3) + 8
            ),
            options=wire.channel_options(s.chunk_bytes),
        )
        add_service(self.service, self.server)
        address = f"{host or s.host}:{port if port >= 0 else s.port}"
        credentials = wire.server_credentials(s)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError as error:  # gRPC says only "Failed to bind"; say what to do.
            raise RuntimeError(
                f"the syncer cannot listen on {address}: the port is in use (another syncer "
                "still running?) or the host is not an address of this machine; pick another "
                f"--port, or --port=0 for any free one ({error})"
            ) from None
        self._stop = threading.Event()
        self._closer = threading.Thread(target=self._close_rounds, daemon=True)

    def _close_rounds(self) -> None:
        while not self._stop.is_set():
            deadline = self.state.next_deadline()
            wait = 0.05 if deadline is None else max(min(deadline - self.state.clock(), 0.05), 0)
            self._stop.wait(wait)
            self.state.tick()

    def start(self) -> SyncerServer:
        """Starts serving; returns self."""
        if self.committer is not None:
            self.committer.start()
        self.server.start()
        self._closer.start()
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (in-flight calls get `grace_s` to finish)."""
        self._stop.set()
        self.server.stop(grace_s).wait()
        if self.committer is not None:
            self.committer.stop()
