"""A hostile peer against a real syncer over gRPC, with messages built from `syncer.proto` alone.

The client here does not use the package's client or wire helpers: its message classes are
generated from the .proto at test time (under another package name, so that they do not clash
with the package's own; the wire bytes are the same), and it writes chunks by hand. Every test
checks the status code, that the syncer's state is unchanged (versions, finite values,
counters), and that it still answers Status.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import math
import sys
import threading
import time
import zlib

import grpc
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoupled_diloco.comm import auth
from decoupled_diloco.comm.auth import OPERATOR
from decoupled_diloco.config import max_push_steps
from decoupled_diloco.syncer.guard import Guard
from decoupled_diloco.syncer.server import SyncerServer
from decoupled_diloco.tasks import make_task
from tests.helpers import ROOT
from tests.test_syncer import _config as syncer_config

TOKEN = "hostile-test-token"
SERVICE = "/decoupled_diloco.Syncer/"


@pytest.fixture(scope="module")
def hp(tmp_path_factory):
    """Message classes generated from the .proto now (package renamed: same wire format)."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("proto")
    text = (ROOT / "decoupled_diloco/comm/syncer.proto").read_text()
    (out / "hostile.proto").write_text(
        text.replace("package decoupled_diloco;", "package hostile;")
    )
    assert (
        protoc.main(["protoc", f"-I{out}", f"--python_out={out}", str(out / "hostile.proto")]) == 0
    )
    spec = importlib.util.spec_from_file_location("hostile_pb2", out / "hostile_pb2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hostile_pb2"] = module
    spec.loader.exec_module(module)
    return module


def _config(**overrides):
    """test_syncer's syncer, with short idle cuts and waits."""
    timing = {"decoupled.syncer.stream_idle_s": 1.0, "decoupled.syncer.rpc_timeout_s": 5.0}
    return syncer_config(**{**timing, **overrides})


class Peer:
    """A raw client: one channel, methods called by path with the generated messages."""

    def __init__(self, hp, port: int, secret: str):
        self.hp, self.secret = hp, secret
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.md = (("x-dd-run-token", secret),)
        self.inc: dict[int, int] = {}  # learner -> incarnation of its last registration

    def unary(self, method, request, reply_type, timeout=10.0, secret=None):
        call = self.channel.unary_unary(
            SERVICE + method,
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=reply_type.FromString,
        )
        md = self.md if secret is None else (("x-dd-run-token", secret),)
        return call(request, timeout=timeout, metadata=md)

    def register(self, learner_id, fingerprint):
        request = self.hp.RegisterRequest(learner_id=learner_id, fingerprint=fingerprint)
        reply = self.unary("Register", request, self.hp.RegisterReply)
        self.inc[learner_id] = reply.incarnation
        return reply

    def chunks(self, specs, arrays, learner=0, **kwargs):
        """`push_chunks` stamped with the learner's current incarnation."""
        kwargs.setdefault("incarnation", self.inc.get(learner, 0))
        return push_chunks(self.hp, specs, arrays, learner=learner, **kwargs)

    def heartbeat(self, **fields):
        return self.unary("Heartbeat", self.hp.HeartbeatRequest(**fields), self.hp.HeartbeatReply)

    def status_s(self) -> float:
        t0 = time.perf_counter()
        self.unary("Status", self.hp.StatusRequest(), self.hp.StatusReply, timeout=5.0)
        return time.perf_counter() - t0

    def push_raw(self, chunks, timeout=10.0):
        call = self.channel.stream_unary(
            SERVICE + "Push",
            request_serializer=None,
            response_deserializer=self.hp.PushReply.FromString,
        )
        return call(iter(chunks), timeout=timeout, metadata=self.md)

    def pull(self, **fields):
        call = self.channel.unary_stream(
            SERVICE + "Pull",
            request_serializer=self.hp.PullRequest.SerializeToString,
            response_deserializer=self.hp.FragmentChunk.FromString,
        )
        return list(call(self.hp.PullRequest(**fields), timeout=10.0, metadata=self.md))

    def close(self):
        self.channel.close()


def tensor_headers(hp, specs, scheme="none"):
    out = []
    for s in specs:
        n = math.prod(s.shape)
        out.append(
            hp.TensorHeader(
                name=s.name,
                shape=list(s.shape),
                dtype=s.dtype,
                scheme=scheme,
                format_version=1,
                payload_bytes=n * np.dtype(s.dtype).itemsize,
            )
        )
    return out


def push_chunks(
    hp,
    specs,
    arrays,
    *,
    learner=0,
    fragment=0,
    rnd=0,
    steps=4,
    tokens=1024,
    incarnation=0,
    chunk=4096,
    crc=None,
    base=0,
    reorder=False,
    extra=0,
):
    payload = b"".join(np.ascontiguousarray(a, "<f4").tobytes() for a in arrays)
    header = hp.PushHeader(
        learner_id=learner,
        fragment=fragment,
        round=rnd,
        base_version=base,
        steps=steps,
        tokens=tokens,
        tensors=tensor_headers(hp, specs),
        total_bytes=len(payload),
        incarnation=incarnation,
    )
    pieces = [payload[i : i + chunk] for i in range(0, len(payload), chunk)] + [
        b"\0" * 4096
    ] * extra
    chunks = [hp.PushChunk(header=header, data=pieces[0]).SerializeToString()]
    chunks += [hp.PushChunk(seq=i, data=d).SerializeToString() for i, d in enumerate(pieces[1:], 1)]
    if reorder:
        chunks[1], chunks[2] = chunks[2], chunks[1]
    crc = zlib.crc32(b"".join(pieces)) if crc is None else crc  # the last chunk: the checksum
    return chunks + [hp.PushChunk(seq=len(chunks), payload_crc32=crc).SerializeToString()]


@pytest.fixture(scope="module")
def server():
    s = SyncerServer(_config(), host="127.0.0.1", port=0, token=TOKEN).start()
    yield s
    s.stop(0)


@pytest.fixture
def peer(hp, server):
    p = Peer(hp, server.port, TOKEN)
    for i in (0, 1):
        p.register(i, server.fingerprint)
    yield p
    p.close()


def snapshot(state):
    with state.lock:
        return {
            "versions": [f.version for f in state.fragments],
            "values": [[v.copy() for v in f.values] for f in state.fragments],
            "pending": [sorted(f.pending) for f in state.fragments],
            "merges": sum(f.merges for f in state.fragments),
        }


def assert_unchanged(server, before, peer):
    after = snapshot(server.state)
    assert after["versions"] == before["versions"]
    assert after["pending"] == before["pending"] and after["merges"] == before["merges"]
    for vals0, vals1 in zip(before["values"], after["values"], strict=True):
        for a, b in zip(vals0, vals1, strict=True):
            assert np.isfinite(b).all()
            np.testing.assert_array_equal(a, b)
    assert peer.status_s() < 5.0  # still answers


def refused(fn, code):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def small(specs, value=1e-3):
    return [np.full(s.shape, value, np.float32) for s in specs]


def test_counters_zero_tokens_overflow_and_excess_are_refused(hp, server, peer):
    specs = server.state.fragments[0].specs
    before = snapshot(server.state)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for steps, tokens, field in [
        (4, 0, "tokens"),  # row 1: weights 0/0
        (1, 2**63 - 1, "tokens"),  # row 3: overflow
        (1, 10**9, "tokens"),  # row 4: more tokens than a step makes
        (0, 256, "steps"),
        (10**6, 256, "steps"),  # more steps than the run
    ]:
        chunks = peer.chunks(specs, small(specs), steps=steps, tokens=tokens, rnd=steps + 7)
        assert field in refused(lambda c=chunks: peer.push_raw(c), invalid)
    assert_unchanged(server, before, peer)


def test_huge_finite_outer_gradients_are_refused_by_norm(hp, server, peer):
    specs = server.state.fragments[0].specs
    before = snapshot(server.state)
    chunks = peer.chunks(specs, small(specs, 1e20), rnd=100)  # row 2
    assert "norm" in refused(lambda: peer.push_raw(chunks), grpc.StatusCode.INVALID_ARGUMENT)
    # An int8 payload whose block scales are 3e38: every decoded value finite, the norm not.
    headers = []
    parts = []
    for s in specs:
        n = math.prod(s.shape)
        blocks = -(-n // 256)
        parts += [np.full(blocks, 3e38, "<f4").tobytes(), np.full(n, 127, np.int8).tobytes()]
        headers.append(
            hp.TensorHeader(
                name=s.name,
                shape=list(s.shape),
                dtype=s.dtype,
                scheme="int8",
                block_size=256,
                format_version=1,
                payload_bytes=4 * blocks + n,
            )
        )
    payload = b"".join(parts)
    header = hp.PushHeader(
        learner_id=0,
        fragment=0,
        round=101,
        steps=4,
        tokens=1024,
        tensors=headers,
        total_bytes=len(payload),
        incarnation=peer.inc[0],
    )
    chunks = [
        hp.PushChunk(header=header, data=payload).SerializeToString(),
        hp.PushChunk(seq=1, payload_crc32=zlib.crc32(payload)).SerializeToString(),
    ]
    details = refused(lambda: peer.push_raw(chunks), grpc.StatusCode.INVALID_ARGUMENT)
    assert "norm" in details or "finite" in details or "scale" in details
    assert_unchanged(server, before, peer)


def test_weight_share_of_one_push_is_capped(hp, server, peer):
    """Row 4 within the bounds: a push claiming the most work a run allows against an honest one."""
    specs = server.state.fragments[1].specs
    state, cap = server.state, server.state.config.decoupled.syncer.max_weight_share
    train_steps, tps = (
        state.config.train_steps,
        make_task(state.config).tokens_per_step(state.config.data.batch_size),
    )
    merges = len(state.merge_log)
    honest = peer.push_raw(peer.chunks(specs, small(specs), learner=0, fragment=1, rnd=0))
    greedy = peer.push_raw(
        peer.chunks(
            specs,
            small(specs, -1e-3),
            learner=1,
            fragment=1,
            rnd=0,
            steps=train_steps,
            tokens=train_steps * tps,
        )
    )
    assert honest.accepted and greedy.accepted
    log = state.merge_log[merges]
    assert log["learners"] == [0, 1]
    # Uncapped, the greedy push would take (8·256)²/8 / ((4·256)²/4 + (8·256)²/8) = 2/3.
    assert log["weights"][1] / sum(log["weights"]) == pytest.approx(2 / 3)
    assert max(log["shares"]) <= cap + 1e-9 and sum(log["shares"]) == pytest.approx(1.0)
    # Superseding pushes cannot add their counters past the run's length (on data leases a
    # push naming its batches may count the budget's steps: `max_push_steps`; these name none).
    before = snapshot(state)
    assert max_push_steps(state.config) >= max_push_steps(state.config, False) == train_steps
    peer.push_raw(
        peer.chunks(
            specs,
            small(specs),
            learner=1,
            fragment=1,
            rnd=1,
            steps=train_steps,
            tokens=tps,
            base=state.fragments[1].version,
        )
    )
    details = refused(
        lambda: peer.push_raw(
            peer.chunks(
                specs,
                small(specs),
                learner=1,
                fragment=1,
                rnd=2,
                steps=1,
                tokens=tps,
                base=state.fragments[1].version,
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "max_push_steps" in details
    with state.lock:  # clean up the pending push for the next tests
        state.fragments[1].pending.clear()
    assert state.fragments[1].version == before["versions"][1]


def test_non_finite_or_negative_waits_are_refused(hp, server, peer):
    before = snapshot(server.state)
    for wait in (float("nan"), -1.0, float("inf")):
        details = refused(
            lambda w=wait: peer.pull(learner_id=0, fragment=0, min_version=2**62, wait_s=w),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "wait_s" in details
    assert_unchanged(server, before, peer)


def test_idle_and_excess_streams_do_not_starve_control_calls(hp, server, peer):
    """Row 6: one learner's 22 push streams that send nothing, and 22 pulls for version 2^62."""
    before = snapshot(server.state)
    stop = threading.Event()
    as0 = Peer(hp, server.port, auth.learner_credential(TOKEN, 0))

    def silent():
        yield from ()
        stop.wait(30)

    call = as0.channel.stream_unary(SERVICE + "Push", request_serializer=None)
    try:
        futures = [call.future(silent(), metadata=as0.md) for _ in range(22)]
        with concurrent.futures.ThreadPoolExecutor(22) as pool:
            pulls = [
                pool.submit(as0.pull, learner_id=0, fragment=0, min_version=2**62, wait_s=1e9)
                for _ in range(22)
            ]
            latencies = [peer.status_s() for _ in range(20)]
            codes = [_code(f) for f in futures]  # refused (streams per learner) or cut when idle
            stop.set()
            pull_codes = [_code(f) for f in pulls]
    finally:
        stop.set()
        as0.close()
    assert max(latencies) < 5.0
    assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.CANCELLED in codes
    # Answered "nothing new" once the syncer's own bound on waits passed, or refused.
    assert set(pull_codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert server.service.guard.stats()["idle_cuts"] >= 1
    assert_unchanged(server, before, peer)


def test_a_pull_behind_flow_control_is_paced_by_its_bytes_not_cut_as_idle(hp):
    """A reader that pauses past `stream_idle_s` (what a slow link looks like from the server
    once HTTP/2's window is full) gets its whole reply; one that stops reading is cut once the
    reply has taken `stream_idle_s` plus its bytes at `min_pull_bytes_per_s`."""
    config = _config(
        **{
            "model.d_model": 128,
            "model.num_layers": 2,
            "model.mlp_hidden": 512,
            "decoupled.fragments": 1,
            "decoupled.syncer.chunk_bytes": 1 << 16,
            "decoupled.syncer.min_pull_bytes_per_s": 500_000.0,
        }
    )
    s = SyncerServer(config, host="127.0.0.1", port=0, token=TOKEN).start()
    # No BDP probing: the reader's window stays at 64 KiB, so the syncer's sends block at once.
    channel = grpc.insecure_channel(f"127.0.0.1:{s.port}", options=[("grpc.http2.bdp_probe", 0)])
    try:
        total = sum(v.nbytes for v in s.state.fragments[0].values)
        assert total > 2_000_000  # far past the window: the sends wait for the reader
        call = channel.unary_stream(
            SERVICE + "Pull",
            request_serializer=hp.PullRequest.SerializeToString,
            response_deserializer=hp.FragmentChunk.FromString,
        )
        request = hp.PullRequest(learner_id=-1, fragment=0, min_version=0, wait_s=0)
        md = (("x-dd-run-token", TOKEN),)
        got = 0
        for i, chunk in enumerate(call(request, timeout=60, metadata=md)):
            got += len(chunk.data)
            if i == 1:  # twice the idle cut with nothing taken (budget: 1 s + 4.5 s of bytes)
                time.sleep(2.0)
        assert got == total and s.service.guard.stats()["idle_cuts"] == 0
        stalled = call(request, timeout=60, metadata=md)
        next(stalled)  # one chunk, then never another
        t0 = time.monotonic()
        deadline = t0 + 30
        while s.service.guard.stats()["idle_cuts"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() - t0 < 20  # ~5.5 s budget, cut within the watcher's period
        with pytest.raises(grpc.RpcError) as cut:  # what was buffered, then the cut
            sum(len(chunk.data) for chunk in stalled)
        assert cut.value.code() == grpc.StatusCode.CANCELLED
        assert s.service.guard.stats()["idle_cuts"] == 1
    finally:
        channel.close()
        s.stop(0)


def test_one_learners_pulls_at_once_share_its_links_minimum_pace():
    """Issue 22: behind a slow link a learner's P merges come down together, each at 1/P of
    its link; each must average `min_pull_bytes_per_s` / k with k of them under way."""
    now = [100.0]
    guard = Guard(
        slots=8, per_caller=4, max_bytes=1, idle_s=1.0, min_pull_rate=1000.0, clock=lambda: now[0]
    )
    try:
        with (
            guard.call(1, None, "pull") as a,
            guard.call(1, None, "pull") as b,
            guard.call(2, None, "pull") as c,
        ):
            a.budget(4000)
            assert a.until == 100.0 + 1.0 + 4.0  # alone: its bytes at 1000 B/s
            now[0] = 102.0
            b.budget(4000)  # two of learner 1's replies share its link: 500 B/s each
            assert b.until == 102.0 + 1.0 + 8.0
            assert a.until == 100.0 + 1.0 + 8.0  # extended, from its own start
            c.budget(4000)  # another learner's link: its own pace
            assert c.until == 102.0 + 1.0 + 4.0
        with guard.call(OPERATOR, None, "pull") as d, guard.call(OPERATOR, None, "pull") as e:
            d.budget(4000)
            e.budget(4000)  # the run token's calls (evaluator, tools) are not one link
            assert d.until == e.until == 102.0 + 1.0 + 4.0
    finally:
        guard.close()


def _code(future):
    try:
        future.result(timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()


def test_payload_past_its_declared_size_is_refused(hp, server, peer):
    specs = server.state.fragments[0].specs
    before = snapshot(server.state)
    chunks = peer.chunks(specs, small(specs), rnd=200, extra=50)
    details = refused(lambda: peer.push_raw(chunks), grpc.StatusCode.INVALID_ARGUMENT)
    assert "declared" in details
    assert_unchanged(server, before, peer)


def test_the_token_is_checked_before_the_body_is_parsed(hp, server, peer):
    before = snapshot(server.state)
    garbage = b"\xff" * (4 << 20)  # not a protobuf at all
    for method, reply in (("Heartbeat", hp.HeartbeatReply), ("Register", hp.RegisterReply)):
        refused(
            lambda m=method, r=reply: peer.unary(m, garbage, r, secret="wrong"),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        refused(
            lambda m=method, r=reply: peer.unary(m, garbage, r), grpc.StatusCode.INVALID_ARGUMENT
        )
    assert_unchanged(server, before, peer)


def test_heartbeat_fields_are_bounded(hp, server, peer):
    before = snapshot(server.state)
    for fields in (
        {"versions": list(range(10_000))},
        {"step_time_s": float("nan")},
        {"blocked_s": float("inf")},
        {"state": "x" * 1000},
        {"step": -5},
        {"phase_step": 2**60},  # others would extrapolate and follow it
    ):
        refused(
            lambda f=fields: peer.heartbeat(learner_id=0, **f), grpc.StatusCode.INVALID_ARGUMENT
        )
    assert_unchanged(server, before, peer)


def test_unregistered_learners_cannot_pull(hp, server, peer):
    refused(
        lambda: peer.pull(learner_id=1500, fragment=0, min_version=0, wait_s=0.0),
        grpc.StatusCode.FAILED_PRECONDITION,
    )


def test_a_learner_acts_only_as_itself(hp, server, peer):
    specs = server.state.fragments[0].specs
    before = snapshot(server.state)
    as0 = Peer(hp, server.port, auth.learner_credential(TOKEN, 0))
    try:
        denied = grpc.StatusCode.PERMISSION_DENIED
        chunks = peer.chunks(specs, small(specs), learner=1, rnd=300)
        refused(lambda: as0.push_raw(chunks), denied)  # relabelled push
        refused(lambda: as0.heartbeat(learner_id=1, state="done"), denied)
        refused(lambda: as0.register(1, server.fingerprint), denied)
        forged = auth.learner_credential("another-token", 1)
        refused(lambda: Peer(hp, server.port, forged).status_s(), grpc.StatusCode.UNAUTHENTICATED)
        # Its own calls work.
        assert as0.heartbeat(learner_id=0).versions == before["versions"]
    finally:
        as0.close()
    assert_unchanged(server, before, peer)


def test_a_replay_after_re_registration_is_refused(hp, server, peer):
    specs = server.state.fragments[0].specs
    old = server.state.learners[0].incarnation
    chunks = peer.chunks(specs, small(specs), learner=0, rnd=400, incarnation=old)
    peer.register(0, server.fingerprint)  # a new incarnation
    before = snapshot(server.state)
    details = refused(lambda: peer.push_raw(chunks), grpc.StatusCode.INVALID_ARGUMENT)
    assert "incarnation" in details
    assert_unchanged(server, before, peer)


def test_reordered_chunks_and_bad_checksums_are_refused(hp, server, peer):
    specs = server.state.fragments[0].specs
    before = snapshot(server.state)
    chunks = peer.chunks(specs, small(specs), rnd=500, chunk=1024, reorder=True)
    assert "seq" in refused(lambda: peer.push_raw(chunks), grpc.StatusCode.INVALID_ARGUMENT)
    chunks = peer.chunks(specs, small(specs), rnd=501, crc=1234)
    assert "checksum" in refused(lambda: peer.push_raw(chunks), grpc.StatusCode.INVALID_ARGUMENT)
    unsigned = peer.chunks(specs, small(specs), rnd=502)[:-1]  # no checksum chunk at the end
    details = refused(lambda: peer.push_raw(unsigned), grpc.StatusCode.INVALID_ARGUMENT)
    assert "payload_crc32" in details
    assert_unchanged(server, before, peer)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.integers(-(2**63), 2**63 - 1),
    tokens=st.integers(-(2**63), 2**63 - 1),
    base=st.integers(-(2**63), 2**63 - 1),
    fragment=st.integers(-(2**31), 2**31 - 1),
    value=st.floats(allow_nan=True, allow_infinity=True, width=32),
    total=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    tail=st.binary(max_size=64),
)
def test_fuzzed_pushes_never_poison_the_model(
    hp, server, peer, steps, tokens, base, fragment, value, total, tail
):
    """Structured fuzzing of the push header: refused with a status, never a non-finite model."""
    specs = server.state.fragments[0].specs
    chunks = peer.chunks(
        specs, small(specs, value), rnd=10**6, steps=steps, tokens=tokens, base=base
    )
    first = hp.PushChunk.FromString(chunks[0])
    first.header.fragment = fragment
    if total is not None:
        first.header.total_bytes = total
    chunks[0] = first.SerializeToString()
    if tail:
        chunks.append(tail)
    try:
        peer.push_raw(chunks, timeout=10.0)
    except grpc.RpcError as error:
        assert error.code() in {
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION,
        }, error.details()
    with server.state.lock:
        for f in server.state.fragments:
            f.pending.clear()  # an accepted one would otherwise wait for learner 1
            assert all(np.isfinite(v).all() for v in f.values)


def test_a_merge_that_would_poison_the_fragment_is_refused(tmp_path):
    """Defence in depth: pushes that got past admission cannot commit a non-finite version."""
    from decoupled_diloco.syncer import wal as wal_lib
    from decoupled_diloco.syncer.records import Push
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    config = _config()
    cut, values = initial_fragments(config)
    state = SyncerState(config, cut, values)
    state.wal = wal_lib.WriteAheadLog(tmp_path / "0.log")
    for i in (0, 1):
        state.register(i, "")
    small_delta = [np.full(s.shape, 1e-3, np.float32) for s in cut[0]]
    for i in (0, 1):  # an honest round first: version 1, momentum built
        state.push(Push(i, 0, 0, 0, 4, 1024, small_delta))
    frag = state.fragments[0]
    momentum = lambda f: [x for x in jax.tree.leaves(f.opt_state) if np.ndim(x)]  # noqa: E731
    assert frag.version == 1 and any(np.any(x) for x in momentum(frag))
    before = [v.copy() for v in frag.values]
    big = [np.full(s.shape, 3e38, np.float32) for s in cut[0]]  # finite, but the merge overflows
    for i in (0, 1):
        state.push(Push(i, 0, 1, 1, 4, 1024, big))
    assert frag.version == 1 and frag.refused_merges == 1 and not frag.pending
    assert [state.learners[i].dropped_pushes for i in (0, 1)] == [1, 1]
    assert all(not np.any(x) for x in momentum(frag))  # it started again
    for a, b in zip(before, frag.values, strict=True):
        np.testing.assert_array_equal(a, b)
    state.wal.close()
    state.wal = None
    records = list(wal_lib.read(tmp_path / "0.log"))
    kinds = [header["kind"] for header, _ in records]
    assert kinds.count("merge") == 1 and kinds.count("push") == 4 and kinds[-1] == "refuse"
    # A restart replaying the log does not bring the dropped pushes back.
    replayed = SyncerState(config, cut, values)
    with replayed.lock:
        for header, arrays in records:
            wal_lib.apply(replayed, header, arrays)
    again = replayed.fragments[0]
    assert not again.pending and again.version == 1 and again.refused_merges == 1
    assert [replayed.learners[i].dropped_pushes for i in (0, 1)] == [1, 1]
    assert all(not np.any(x) for x in momentum(again))
    # An honest round afterwards merges as usual.
    for i in (0, 1):
        state.push(Push(i, 0, 2, 1, 4, 1024, small_delta))
    assert frag.version == 2 and all(np.isfinite(v).all() for v in frag.values)


def test_push_bytes_in_flight_are_bounded_and_the_refusal_is_retryable(hp, server, peer):
    """Row 7: reservations come from the headers; past the bound a push is refused at once.

    It does not wait for room (gRPC would buffer a waiting push's chunks in memory); the
    refusal is retryable, and once room frees the same push goes on.
    """
    from decoupled_diloco.comm import retry

    specs = server.state.fragments[0].specs
    guard = server.service.guard
    per_push = sum(s.nbytes for s in specs)
    held = guard.max_bytes // per_push  # pushes that fit at once
    release = threading.Event()
    before = snapshot(server.state)

    def slow(rnd):
        chunks = peer.chunks(specs, small(specs), rnd=rnd, chunk=16)
        assert len(chunks) > 200  # enough to keep the stream moving for 20 s and more

        def gen():
            yield chunks[0]  # the header: its bytes are reserved now
            for piece in chunks[1:-1]:  # a few bytes now and then: never idle, never done
                if release.wait(0.1):
                    return
                yield piece

        return gen()

    call = peer.channel.stream_unary(SERVICE + "Push", request_serializer=None)
    pending = [call.future(slow(900 + i), metadata=peer.md) for i in range(held)]
    try:
        wait_until_reserved = time.monotonic() + 30
        while guard.stats()["bytes_in_flight"] < held * per_push:
            assert time.monotonic() < wait_until_reserved, guard.stats()
            time.sleep(0.02)
        # A push that does not fit is refused (at once: the memory this saves is measured by
        # tools/bench_security, not timed here).
        refused_before = guard.stats()["refused"]
        bad = peer.chunks(specs, small(specs), rnd=951)
        last = hp.PushChunk.FromString(bad[-1])
        last.payload_crc32 ^= 1  # a wrong checksum: once read, it changes nothing either
        bad = [*bad[:-1], last.SerializeToString()]
        with pytest.raises(grpc.RpcError) as info:
            peer.push_raw(bad)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "in flight" in info.value.details() and retry.retryable(info.value)
        assert guard.stats()["refused"] == refused_before + 1
        assert guard.stats()["bytes_in_flight"] <= guard.max_bytes
        # Once the holders end, the same push, retried, gets its room: it is read and checked.
        release.set()
        for f in pending:
            _code(f)
        with pytest.raises(grpc.RpcError) as info:
            peer.push_raw(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checksum" in info.value.details()
    finally:
        release.set()
        for f in pending:
            _code(f)
    # A push too big for the syncer at all is not retried.
    header = hp.PushHeader(learner_id=0, tensors=tensor_headers(hp, specs), total_bytes=10**9)
    with pytest.raises(grpc.RpcError) as info:
        peer.push_raw([hp.PushChunk(header=header).SerializeToString()])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not retry.retryable(info.value)
    assert guard.stats()["bytes_in_flight"] == 0
    assert_unchanged(server, before, peer)


def test_callers_that_never_send_a_body_hold_no_thread(hp, server, peer):
    """A unary call's body is read only after its secret is checked, under the control guard."""
    before = snapshot(server.state)
    stop = threading.Event()

    def silent():
        yield from ()
        stop.wait(30)

    stranger = Peer(hp, server.port, "wrong")
    as0 = Peer(hp, server.port, auth.learner_credential(TOKEN, 0))
    try:
        calls = [
            p.channel.stream_unary(SERVICE + method, request_serializer=None).future(
                silent(), metadata=p.md
            )
            for p, method, n in ((stranger, "Register", 100), (as0, "Heartbeat", 10))
            for _ in range(n)
        ]
        latencies = [peer.status_s() for _ in range(20)]
        codes = [_code(f) for f in calls]
    finally:
        stop.set()
        stranger.close()
        as0.close()
    assert set(codes[:100]) == {grpc.StatusCode.UNAUTHENTICATED}
    # Learner 0 may hold 2 control calls; the others are refused, the 2 cut when idle.
    assert set(codes[100:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
    assert max(latencies) < 5.0
    assert_unchanged(server, before, peer)


def test_a_push_crossing_a_slow_link_keeps_its_learner_live(hp):
    """Behind a saturated slow uplink a learner's heartbeats wait behind its push's chunks
    (measured over 30 s at 0.136 Mbit/s): the chunks arriving show it alive, so its leases
    are not handed to others while it pushes. A learner silent as long is not live."""
    config = _config(**{"decoupled.syncer.learner_timeout_s": 1.0})
    server = SyncerServer(config, host="127.0.0.1", port=0, token=TOKEN).start()
    peer = Peer(hp, server.port, TOKEN)
    try:
        for i in (0, 1):
            peer.register(i, server.fingerprint)
        state, specs = server.state, server.state.fragments[0].specs
        chunks = peer.chunks(specs, small(specs), learner=0, fragment=0, rnd=0, chunk=256)
        assert len(chunks) > 30
        live = []

        def paced():  # 3 s of chunks, as a slow link delivers them
            for n, chunk in enumerate(chunks):
                if n < 30:
                    time.sleep(0.1)
                    live.append(state.live_learners(state.clock()))
                yield chunk

        assert peer.push_raw(paced(), timeout=30).accepted
        assert all(0 in x for x in live)
        assert 1 not in live[-1]  # registered, then silent for ~3 s
    finally:
        peer.close()
        server.stop(0)
