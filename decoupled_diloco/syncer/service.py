"""The syncer's RPC handlers: identity, admission and validation in front of `SyncerState`.

Every call must carry the run token or a learner's credential (metadata `x-dd-run-token`,
`comm.auth`), checked before the body is parsed, else UNAUTHENTICATED; a credential acts only
as its learner (PERMISSION_DENIED). Register checks the model fingerprint; pushes are validated
(identity and incarnation, fragment id, tensor names, shapes, dtypes, byte counts and chunk
order against the header, checksum, size limit, counters, finite values, outer-gradient norm:
`syncer.admission`) before anything touches the state, and a bad one is refused with
INVALID_ARGUMENT or RESOURCE_EXHAUSTED and a message. Data calls are admitted by
`syncer.guard` (slots, streams per learner, bytes in flight, idle cuts). How the handlers are
served, every request a raw stream read only after the secret is checked: `syncer.handlers`.
"""

from __future__ import annotations

import collections
import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from absl import logging

from decoupled_diloco.comm import auth, wire
from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import syncer_pb2_grpc as pb_grpc
from decoupled_diloco.comm.retry import RETRY_TRAILER
from decoupled_diloco.config import max_learners, max_push_steps
from decoupled_diloco.core import compression
from decoupled_diloco.syncer import admission, elastic, streams
from decoupled_diloco.syncer.downlink import Downlink
from decoupled_diloco.syncer.guard import Guard, control_slots, data_slots, streams_per_learner
from decoupled_diloco.syncer.payloads import Payload
from decoupled_diloco.syncer.records import Push
from decoupled_diloco.syncer.state import PushRefused, SyncerState

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class SyncerService(pb_grpc.SyncerServicer):
    """The RPC handlers: identity, admission and validation in front of `SyncerState`.

    Every call is checked in this order: the caller's secret from the metadata (`comm.auth`:
    the run token or one learner's credential), before any byte of the body is parsed; then
    the capacity of data calls (`syncer.guard`); then every field (`syncer.admission`,
    `comm.wire`). Only then does the state see the request.
    """

    def __init__(
        self,
        state: SyncerState,
        token: str,
        fingerprint: str,
        tokens_per_step: int,
        tokens_per_unit: int = 0,
    ):
        self.state, self.token, self.fingerprint = state, token, fingerprint
        self.tokens_per_step = tokens_per_step  # the task's: bounds a push's token count
        # A constant global batch's ledger unit, in tokens: a push's tokens are its units'.
        self.tokens_per_unit = tokens_per_unit
        self.committer: Any = None  # set by `SyncerServer` when the state is durable
        config = state.config
        self.syncer_config = s = config.decoupled.syncer
        z = config.compression
        # Compressed downlink: per-learner differences from the copy each one holds.
        lossy = z.downlink and z.scheme != "none"
        self.downlink = Downlink(compression.codec_for(z)) if lossy else None
        model_bytes = sum(x.nbytes for f in state.fragments for x in f.specs)
        per_learner = streams_per_learner(config)
        self.guard = Guard(
            slots=data_slots(config),
            per_caller=per_learner,
            operator_calls=per_learner * (config.num_learners + 1),
            max_bytes=s.max_inflight_bytes or 2 * config.num_learners * model_bytes,
            idle_s=s.stream_idle_s,
            min_pull_rate=s.min_pull_bytes_per_s,
        )
        # Control calls have threads of their own (`CONTROL_THREADS` beyond M per learner): a
        # learner may hold 2 at once (a heartbeat and a registration), the run token 8.
        self.control = Guard(
            slots=control_slots(config),
            per_caller=2,
            operator_calls=8,
            max_bytes=0,
            idle_s=min(s.stream_idle_s, 10.0),
            calls="control calls",
            per_caller_field="2 per learner, 8 with the run token",
        )
        self.malformed = 0  # requests refused before they reached the state
        # For `syncer.metrics`: refusals by status code, payload bytes in (pushes) and out.
        self.refused: collections.Counter[str] = collections.Counter()
        self.traffic = {"received": 0, "sent": 0}
        self.counting_lock = threading.Lock()

    def _count(self, what: str, n: int) -> None:
        with self.counting_lock:
            self.traffic[what] += n

    def _abort(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        """Ends the call with `code` and `message`, counted by code (`refused`)."""
        with self.counting_lock:
            self.refused[code.name.lower()] += 1
        context.abort(code, message)

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        """`_abort` for a request that is malformed or not allowed (also counted and logged)."""
        with self.counting_lock:
            self.malformed += 1
        logging.log_every_n_seconds(logging.WARNING, "[syncer] refused: %s", 5.0, message)
        self._abort(context, code, message)

    def authorize(self, context: grpc.ServicerContext) -> int:
        """The caller's identity (`auth.OPERATOR` or a learner id), or UNAUTHENTICATED."""
        got = dict(context.invocation_metadata()).get(wire.TOKEN_HEADER, "")
        identity = auth.identify(got if isinstance(got, str) else "", self.token)
        if identity is None:
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong run token")
        return identity

    def _parse(self, message_type: Any, raw: bytes | None, context: grpc.ServicerContext) -> Any:
        try:
            return message_type.FromString(raw if raw is not None else b"")
        except Exception:  # noqa: BLE001 - any decode failure is the peer's, not ours
            self._refuse(context, _INVALID, f"malformed {message_type.__name__}")

    def _as(self, identity: int, learner_id: int, context: grpc.ServicerContext) -> None:
        """A learner's credential acts only as that learner (the operator as anyone)."""
        if identity not in (auth.OPERATOR, learner_id):
            self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"learner {identity}'s credential cannot act as learner {learner_id}",
            )

    def _fragment(self, p: int, context: grpc.ServicerContext) -> None:
        if not 0 <= p < len(self.state.fragments):
            self._refuse(
                context,
                _INVALID,
                f"fragment {p} does not exist (the model has {len(self.state.fragments)})",
            )
        if p not in self.state.owned:
            shards = self.state.config.decoupled.syncer.shards
            self._abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"fragment {p} belongs to syncer shard {p % shards} of {shards}, not this one",
            )

    def _durable(self, context: grpc.ServicerContext) -> None:
        """Waits until every change so far is committed (see `syncer.durability`)."""
        if not self.state.wait_committed(self.state.seq, self.syncer_config.rpc_timeout_s):
            self._abort(
                context, grpc.StatusCode.UNAVAILABLE, "the syncer could not commit its state"
            )

    def _known(self, learner_id: int, context: grpc.ServicerContext) -> None:
        if learner_id not in self.state.learners:
            self._abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"learner {learner_id}: register first",
            )

    def Register(self, identity: int, raw: bytes | None, context: grpc.ServicerContext):  # noqa: D102
        request = self._parse(pb.RegisterRequest, raw, context)
        self._as(identity, request.learner_id, context)
        limit = max_learners(self.state.config)
        if not 0 <= request.learner_id < limit:
            self._refuse(
                context,
                _INVALID,
                f"learner id {request.learner_id} is not in [0, {limit}) (decoupled.max_learners)",
            )
        if request.fingerprint != self.fingerprint:
            what = admission.fingerprint_mismatch(request.fingerprint, self.fingerprint)
            self._abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"learner {request.learner_id} {what}; start both with the same config.task "
                "and config.model",
            )
        versions, incarnation = self.state.register(request.learner_id, request.mesh[:64])
        self._durable(context)
        return pb.RegisterReply(
            num_fragments=len(versions), versions=versions, incarnation=incarnation
        )

    def Heartbeat(self, identity: int, raw: bytes | None, context: grpc.ServicerContext):  # noqa: D102
        r = self._parse(pb.HeartbeatRequest, raw, context)
        self._as(identity, r.learner_id, context)
        self._known(r.learner_id, context)
        numbers = {
            "loss": r.loss,
            "eval_loss": r.eval_loss,
            "blocked_s": r.blocked_s,
            "step_time_s": r.step_time_s,
        }
        counters = {
            "bytes_sent": r.bytes_sent,
            "bytes_received": r.bytes_received,
            "sync_rounds": r.sync_rounds,
            "phase_step": r.phase_step,
        }
        error = admission.check_heartbeat(
            r.step, r.tokens, numbers, counters, r.versions, r.state, len(self.state.fragments)
        )
        if error:
            self._refuse(context, _INVALID, f"heartbeat of learner {r.learner_id}: {error}")
        versions = self.state.heartbeat(
            r.learner_id,
            step=r.step,
            tokens=r.tokens,
            state=r.state or "training",
            versions=list(r.versions),
            **numbers,
            **counters,
        )
        lead, lead_step_s = elastic.lead_step(self.state, r.learner_id)
        return pb.HeartbeatReply(
            versions=versions,
            fastest_step_time_s=self.state.fastest_step_time(),
            live_learners=elastic.live_count(self.state),
            lead_step=lead,
            lead_step_time_s=lead_step_s,
        )

    def Lease(self, identity: int, raw: bytes | None, context: grpc.ServicerContext):  # noqa: D102
        r = self._parse(pb.LeaseRequest, raw, context)
        self._as(identity, r.learner_id, context)
        self._known(r.learner_id, context)
        grant = elastic.lease(self.state, r.learner_id, r.flushed)
        self._durable(context)  # a grant a restart would forget is never handed out
        return pb.LeaseReply(
            status=grant.status,
            lease=grant.lease,
            begin=grant.begin,
            end=grant.end,
            num_shards=grant.num_shards,
            covered=grant.covered,
            live_learners=grant.live,
        )

    def Status(self, identity: int, raw: bytes | None, context: grpc.ServicerContext):  # noqa: D102
        del identity  # any valid secret may read the status
        self._parse(pb.StatusRequest, raw, context)
        status = self.state.status()
        status["guard"] = {**self.guard.stats(), "malformed": self.malformed}
        if self.committer is not None:  # durable syncer: log syncs and snapshots
            status["durability"] = self.committer.stats()
        return pb.StatusReply(json=json.dumps(status))

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext):  # noqa: D102
        identity = self.authorize(context)
        with self.guard.call(identity, context, "push") as activity:
            try:
                return self._push(identity, request_iterator, context, activity)
            except grpc.RpcError:
                if activity.idle_cut:  # cancelled: the client gets CANCELLED, nothing else
                    return pb.PushReply()
                raise

    def _push(
        self,
        identity: int,
        request_iterator: Iterator[bytes],
        context: grpc.ServicerContext,
        activity: Any,
    ) -> pb.PushReply:
        first = self._parse(pb.PushChunk, next(request_iterator, None), context)
        activity.touch()
        if not first.HasField("header") or first.seq != 0:
            self._refuse(context, _INVALID, "a push must start with a header (chunk seq 0)")
        h = first.header
        self._as(identity, h.learner_id, context)
        self._fragment(h.fragment, context)
        self._known(h.learner_id, context)
        frag = self.state.fragments[h.fragment]
        limit = self.syncer_config.max_push_bytes
        try:
            expected = wire.check_headers(h.tensors, frag.specs)
        except wire.PayloadError as error:
            self._refuse(context, _INVALID, f"fragment {h.fragment}: {error}")
        if max(h.total_bytes, expected) > limit:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"push of {max(h.total_bytes, expected)} bytes > limit {limit} "
                "(decoupled.syncer.max_push_bytes)",
            )
        if h.total_bytes != expected:
            self._refuse(
                context, _INVALID, f"header says {h.total_bytes} bytes, tensors need {expected}"
            )
        # (Past `train_steps` only with the batches that show them: data ranges, checked below.)
        bound = max_push_steps(self.state.config, names_data=bool(h.data))
        error = admission.check_counters(h.steps, h.tokens, bound, self.tokens_per_step)
        if error:
            self._refuse(context, _INVALID, f"push of learner {h.learner_id}: {error}")
        if h.base_version > frag.published:
            self._refuse(context, _INVALID, f"base version {h.base_version} is from the future")
        if h.base_version < 0:
            self._refuse(context, _INVALID, f"base version {h.base_version} is negative")
        error = elastic.check_data(self.state, h.learner_id, h.steps, _ranges(h))
        held = sum(r.end - r.begin for r in h.data) * self.tokens_per_unit
        if not error and held and h.tokens != held:
            error = f"tokens={h.tokens}, but its data ranges hold {held}"
        if error:
            self._refuse(context, _INVALID, f"push of learner {h.learner_id}: {error}")
        # The bytes go to a file of the push store as they arrive (never a buffer of the
        # whole payload in memory), as many as the headers declared; they are read back and
        # decoded one tensor at a time.
        activity.reserve(expected)  # or refused at once: past the bound, no waiting for room
        try:
            file = self.state.store.create()
        except OSError as error:
            self._cannot_store(context, error)
        try:
            push = self._receive(h, first, request_iterator, context, activity, file, expected)
        except OSError as error:  # the push store's disk (full, failing): nothing was accepted
            file.abort()
            self._cannot_store(context, error)
        except BaseException:
            file.abort()
            raise
        # Received: its bytes are in the push store's file, no longer being received. The merge
        # and the commit wait that follow must not turn other pushes away.
        activity.release()
        try:
            result = self.state.push(push)
        except PushRefused as error:
            self.state.store.drop(push.delta.path)
            self._refuse(context, _INVALID, f"push of learner {h.learner_id}: {error}")
        except BaseException:
            if self.state.wal_failed:  # (its file stays: the log may refer to it)
                self._abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    f"the syncer's write-ahead log failed ({self.state.wal_failed}); it stops",
                )
            self.state.store.drop(push.delta.path)
            raise
        if result.duplicate or not result.accepted:
            self.state.store.drop(push.delta.path)  # the state did not keep it
        self._durable(context)  # acknowledged only once a restart cannot lose it
        return pb.PushReply(
            accepted=result.accepted,
            duplicate=result.duplicate,
            reason=result.reason,
            version=result.version,
        )

    def _receive(
        self,
        h: pb.PushHeader,
        first: pb.PushChunk,
        request_iterator: Iterator[bytes],
        context: grpc.ServicerContext,
        activity: Any,
        file: Any,
        expected: int,
    ) -> Push:
        """Reads a push's chunks into `file` and checks them; the push, its payload stored."""
        frag = self.state.fragments[h.fragment]

        def ended(n: int) -> None:
            activity.hold()  # complete: the merge and the commit wait are not idleness
            self._count("received", n)

        info = self.state.learners.get(h.learner_id)

        def touch() -> None:  # the call moves, and its learner is alive (`live_learners`)
            activity.touch()
            if info is not None:
                info.last_chunk = self.state.clock()

        try:
            streams.receive(first, request_iterator, expected, file, touch, ended)
        except wire.PayloadError as error:
            self._refuse(context, _INVALID, str(error))
        path = file.finish()
        delta = Payload(frag.specs, [wire.codec_of(t) for t in h.tensors], path=path)
        try:  # decodes (and checks) every tensor before the state sees any of them
            total = sum(admission.norm([x]) ** 2 for x in delta.tensors(check=True))
        except wire.PayloadError as error:
            self._refuse(context, _INVALID, f"fragment {h.fragment}: {error}")
        error = admission.check_norm(
            math.sqrt(total), frag.norm(), frag.flat.size, self.syncer_config.max_delta_norm
        )
        if error:
            self._refuse(context, _INVALID, f"push of learner {h.learner_id}: {error}")
        return Push(
            h.learner_id,
            h.fragment,
            h.round,
            h.base_version,
            h.steps,
            h.tokens,
            delta,
            incarnation=h.incarnation,
            data=_ranges(h),
        )

    def _cannot_store(self, context: grpc.ServicerContext, error: OSError) -> None:
        """Refuses a push whose bytes could not be written (retryable: space may free)."""
        message = (
            f"the syncer cannot store this push ({type(error).__name__}: {error}); its push "
            f"store is {self.state.store.directory}: free disk space there, or give the syncer "
            "another --checkpoint_dir"
        )
        logging.log_every_n_seconds(logging.ERROR, "[syncer] %s", 30.0, message)
        context.set_trailing_metadata(((RETRY_TRAILER, "1"),))
        self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def Pull(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext):  # noqa: D102
        identity = self.authorize(context)
        with self.guard.call(identity, context, "pull") as activity:
            try:
                raw = next(request_iterator, None)
            except grpc.RpcError:
                if activity.idle_cut:
                    return
                raise
            activity.touch()
            request = self._parse(pb.PullRequest, raw, context)
            if request.learner_id >= 0 or identity != auth.OPERATOR:  # the operator pulls as -1
                self._as(identity, request.learner_id, context)
                self._known(request.learner_id, context)
            self._fragment(request.fragment, context)
            error = admission.check_wait(request.wait_s)
            if error:
                self._refuse(context, _INVALID, error)
            wait_s = min(request.wait_s, self.syncer_config.rpc_timeout_s)
            activity.hold()  # its wait for a merge is bounded, not idle
            version, values = self.state.wait_for(
                request.fragment, request.min_version, wait_s, context.is_active
            )
            activity.touch()
            if version < 0:
                yield pb.FragmentChunk(fragment=request.fragment, version=-1)
                return
            specs = self.state.fragments[request.fragment].specs
            size = self.syncer_config.chunk_bytes
            if self.downlink is not None and request.learner_id >= 0:
                chunks = streams.delta_reply(self.downlink, request, version, values, specs, size)
            else:
                chunks = streams.full_reply(request.fragment, version, values, specs, size)
            for i, chunk in enumerate(chunks):
                if i == 0:  # the header chunk: how many payload bytes the reply carries
                    self._count("sent", chunk.total_bytes)
                    activity.budget(chunk.total_bytes)
                activity.hold()  # a send held back by flow control is the link's pace
                yield chunk
                activity.touch()
            self.state.record_sync_time(request.fragment, version, request.learner_id)


def _ranges(h: pb.PushHeader) -> list[list[int]]:
    """A push header's data ranges, [lease, begin, end) each."""
    return [[r.lease, r.begin, r.end] for r in h.data]
