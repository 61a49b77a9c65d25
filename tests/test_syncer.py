"""The syncer over real gRPC on 127.0.0.1 (in-process server): admission, validation, merges."""

import grpc
import numpy as np
import pytest

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import wire
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.core import fragments as F
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config

TOKEN = "test-token"


def _config(**overrides):
    base = {
        "decoupled.fragments": 2,
        "decoupled.quorum": 2,
        "decoupled.syncer.max_grace_s": 0.0,
        "decoupled.syncer.max_push_bytes": 200_000,
        "outer.merge": "rda",
    }
    base.update(overrides)
    return tiny_config(mode="decoupled", **base)


@pytest.fixture
def syncer(request):
    overrides = getattr(request, "param", {})
    server = SyncerServer(_config(**overrides), host="127.0.0.1", port=0, token=TOKEN).start()
    client = SyncerClient(f"127.0.0.1:{server.port}", server.state.config.decoupled.syncer, TOKEN)
    yield server, client
    client.close()
    server.stop(0)


def _snapshot(state):
    return [(f.version, [v.copy() for v in f.values], sorted(f.pending)) for f in state.fragments]


def _assert_same(before, after):
    for (v0, vals0, pend0), (v1, vals1, pend1) in zip(before, after, strict=True):
        assert v0 == v1 and pend0 == pend1
        for a, b in zip(vals0, vals1, strict=True):
            np.testing.assert_array_equal(a, b)


def _push(client, specs, arrays, learner=0, fragment=0, rnd=0, base=0, steps=4, tokens=1024):
    return client.push(
        learner_id=learner,
        fragment=fragment,
        round=rnd,
        base_version=base,
        steps=steps,
        tokens=tokens,
        specs=specs,
        arrays=arrays,
    )


def _two_learners_on_fragment_0(server, client):
    """Registers learners 0 and 1; fragment 0's specs and a copy of its values."""
    for i in (0, 1):
        client.register(i, server.fingerprint)
    fragment = server.state.fragments[0]
    return fragment.specs, [v.copy() for v in fragment.values]


def _deltas(specs, seed, scale=1e-2):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(s.shape)).astype(s.dtype) for s in specs]


def test_every_call_needs_the_run_token(syncer):
    server, client = syncer
    for token in ("", "wrong"):
        metadata = ((wire.TOKEN_HEADER, token),) if token else ()
        with pytest.raises(grpc.RpcError) as info:
            client.stub.Status(pb.StatusRequest(), timeout=10, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            client.stub.Register(pb.RegisterRequest(learner_id=0), timeout=10, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = client.stub.Pull(pb.PullRequest(fragment=0), timeout=10, metadata=metadata)
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.state.learners == {}
    assert client.status()["merges"] == 0


def test_register_checks_the_model_fingerprint(syncer):
    server, client = syncer
    with pytest.raises(grpc.RpcError) as info:
        client.register(0, "0123456789abcdef")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = info.value.details()
    assert "builtin:transformer" in details and "'0123456789abcdef'" in details, details
    assert "config.task" in details and "config.model" in details
    assert server.state.learners == {}
    reply = client.register(0, server.fingerprint, "1x1")
    assert list(reply.versions) == [0, 0] and reply.num_fragments == 2


def test_bad_pushes_are_refused_and_change_nothing(syncer):
    server, client = syncer
    client.register(0, server.fingerprint)
    specs = server.state.fragments[0].specs
    good = _deltas(specs, 0)
    before = _snapshot(server.state)

    def refused(code, text, **kwargs):
        args = {"specs": specs, "arrays": good, **kwargs}
        with pytest.raises(grpc.RpcError) as info:
            _push(client, args.pop("specs"), args.pop("arrays"), **args)
        assert info.value.code() == code, info.value.details()
        assert text in info.value.details()
        _assert_same(before, _snapshot(server.state))

    wrong_shape = [F.TensorSpec(0, specs[0].name, (3, 3), "float32"), *specs[1:]]
    bad = [np.zeros((3, 3), np.float32), *good[1:]]
    refused(grpc.StatusCode.INVALID_ARGUMENT, "expected shape", specs=wrong_shape, arrays=bad)
    as_f16 = [F.TensorSpec(s.index, s.name, s.shape, "float16") for s in specs]
    refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected dtype",
        specs=as_f16,
        arrays=[g.astype(np.float16) for g in good],
    )
    refused(grpc.StatusCode.INVALID_ARGUMENT, "does not exist", fragment=7)
    nan = [g.copy() for g in good]
    nan[-1].flat[0] = np.nan
    refused(grpc.StatusCode.INVALID_ARGUMENT, "non-finite", arrays=nan)
    refused(grpc.StatusCode.INVALID_ARGUMENT, "from the future", base=3)
    # Oversized: headers claim more than the limit, or the stream runs past it.
    header = pb.PushHeader(
        learner_id=0, fragment=0, steps=1, tensors=wire.headers(specs), total_bytes=10**9
    )
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Push(iter([pb.PushChunk(header=header)]), timeout=10, metadata=client.metadata)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A stream past what its headers declare is cut there, before it is buffered.
    header.total_bytes, header.tokens = sum(s.nbytes for s in specs), 1
    big = [pb.PushChunk(header=header, data=b"\0" * 150_000), pb.PushChunk(data=b"\0" * 100_000)]
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Push(iter(big), timeout=10, metadata=client.metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "declared" in info.value.details()
    _assert_same(before, _snapshot(server.state))
    assert client.status()["merges"] == 0


def test_retried_push_counts_once_and_merge_matches_numpy(syncer):
    """Token weights, RDA (mean for embeddings) and the Nesterov step, recomputed in numpy."""
    server, client = syncer
    for i in (0, 1):
        client.register(i, server.fingerprint)
    p = next(
        i for i, f in enumerate(server.state.fragments) if any("embed" in s.name for s in f.specs)
    )
    specs = server.state.fragments[p].specs
    anchor = [v.copy() for v in server.state.fragments[p].values]
    d0, d1 = _deltas(specs, 1), _deltas(specs, 2, scale=3e-2)
    first = _push(client, specs, d0, learner=0, fragment=p, steps=4, tokens=4 * 256)
    again = _push(client, specs, d0, learner=0, fragment=p, steps=4, tokens=4 * 256)
    assert first.accepted and not first.duplicate and again.accepted and again.duplicate
    assert client.status()["fragments"][p]["pending"] == [0]  # quorum 2: still open
    # Learner 1 trained half the tokens per step (a smaller batch): w = tokens²/steps weighs it
    # 1/4 of learner 0, where plain token weighting would give 1/2.
    _push(client, specs, d1, learner=1, fragment=p, steps=4, tokens=4 * 128)
    version, got = client.pull(0, p, min_version=1, wait_s=10)
    assert version == 1
    record = client.status()["merge_log"][-1]
    assert record["learners"] == [0, 1] and record["tokens"] == [1024, 512]
    w = np.array([1024.0**2 / 4, 512.0**2 / 4])
    np.testing.assert_allclose(record["weights"], w)
    w = w / w.sum()
    lr, mu = 0.7, 0.9
    for spec, a, x0, x1, g in zip(specs, anchor, d0, d1, got, strict=True):
        if "embed" in spec.name:
            merged = w[0] * x0 + w[1] * x1
        else:
            n0, n1 = np.linalg.norm(x0), np.linalg.norm(x1)
            direction = w[0] * x0 / n0 + w[1] * x1 / n1
            merged = (w[0] * n0 + w[1] * n1) * direction / np.linalg.norm(direction)
        want = a - lr * (merged + mu * merged)  # first Nesterov step: momentum = merged
        np.testing.assert_allclose(g, want, rtol=2e-5, atol=2e-7)
    # The admission bounds' scale, ‖Θ‖, comes with the merge's values (`FragmentState.norm`).
    merged_norm = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in got))
    np.testing.assert_allclose(server.state.fragments[p].norm(), merged_norm, rtol=1e-5)
    assert client.status()["fragments"][p]["duplicate_pushes"] == 1
    # A restarted learner registers again and numbers its rounds from 0: not a duplicate.
    client.register(0, server.fingerprint)
    fresh = _push(client, specs, d0, learner=0, fragment=p, base=1, steps=4, tokens=1024)
    assert fresh.accepted and not fresh.duplicate


@pytest.mark.parametrize(
    "syncer",
    [{"decoupled.quorum": 1, "decoupled.syncer.max_staleness": 0}],
    indirect=True,
)
def test_late_push_is_dropped_and_changes_nothing(syncer):
    server, client = syncer
    client.register(0, server.fingerprint)
    client.register(1, server.fingerprint)
    specs = server.state.fragments[0].specs
    assert _push(client, specs, _deltas(specs, 1), learner=0).accepted
    assert client.pull(0, 0, min_version=1, wait_s=10)[0] == 1
    before = _snapshot(server.state)
    late = _push(client, specs, _deltas(specs, 2), learner=1, base=0)
    assert not late.accepted and late.reason == "late" and late.version == 1
    _assert_same(before, _snapshot(server.state))
    assert client.status()["fragments"][0]["late_pushes"] == 1


@pytest.mark.parametrize(
    "syncer",
    [
        {"decoupled.quorum": 2, "decoupled.syncer.max_staleness": 1},
        {
            "decoupled.quorum": 2,
            "decoupled.syncer.max_staleness": 1,
            "decoupled.stale_anchor": "learner",
        },
    ],
    indirect=True,
)
def test_stale_push_within_bound_is_anchored_as_configured(syncer):
    server, client = syncer
    specs, theta0 = _two_learners_on_fragment_0(server, client)
    _push(client, specs, _deltas(specs, 1), learner=0)
    _push(client, specs, _deltas(specs, 2), learner=1)
    assert client.pull(0, 0, min_version=1, wait_s=10)[0] == 1
    theta1 = server.state.fragments[0].values
    stale = _deltas(specs, 3)
    reply = _push(client, specs, stale, learner=1, rnd=1, base=0)
    assert reply.accepted and reply.version == 1
    pending = server.state.pending_gradient(0, 1)
    by_syncer = server.state.config.decoupled.stale_anchor == "syncer"
    for got, t0, t1, d in zip(pending, theta0, theta1, stale, strict=True):
        want = t1 - (t0 - d) if by_syncer else d  # re-anchored, or the learner's own Δ
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_grace_window_follows_eq3_with_emas_and_waits_for_a_second_learner():
    from decoupled_diloco.syncer.records import Push, grace_window
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    config = _config(
        **{
            "decoupled.quorum": 1,
            "decoupled.overlap_steps": 2,
            "decoupled.grace_safety": 0.5,
            "decoupled.ema_decay": 0.8,
            "decoupled.syncer.max_grace_s": 10.0,
        }
    )
    cut, values = initial_fragments(config)
    clock = _Clock()
    state = SyncerState(config, cut, values, clock=clock)
    for i in (0, 1):
        state.register(i, "1x1")
    step_times = [0.2, 0.3]
    for i, dt in enumerate(step_times):
        state.heartbeat(i, step_time_s=dt)
    ema_step = 0.8 * step_times[0] + 0.2 * step_times[1]

    def push(learner, rnd, p=0):
        specs = state.fragments[p].specs
        arrays = _deltas(specs, learner + 10 * rnd)
        return state.push(Push(learner, p, rnd, state.fragments[p].version, 4, 1024, arrays))

    # Round 1: learner 0 reaches quorum 1 at t=100 (quorum time 0); learner 1 arrives within
    # the grace window, so both are merged as soon as everyone live has pushed.
    push(0, 0)
    grace = grace_window(ema_step, 0.0, 0.0, overlap_steps=2, safety=0.5, cap_s=10.0)
    assert grace == pytest.approx(0.5 * (2 * ema_step))
    assert state.fragments[0].grace_s == pytest.approx(grace)
    clock.t += grace / 2
    state.tick()
    assert state.fragments[0].version == 0  # still inside the grace window
    push(1, 0)
    assert state.fragments[0].version == 1
    record = state.merge_log[-1]
    assert record["learners"] == [0, 1] and record["grace_s"] == pytest.approx(grace)

    # A sync time sample (the merged fragment reached a learner 0.05 s after the close).
    clock.t += 0.05
    state.record_sync_time(0, 1, learner_id=0)
    # Later pulls of version 1 are not return trips: learner 0's again, the evaluator's (-1).
    clock.t += 0.5
    state.record_sync_time(0, 1, learner_id=0)
    state.record_sync_time(0, 1, learner_id=-1)
    assert state.ema_sync.get() == pytest.approx(0.05)
    # Round 2: only learner 0 pushes; the window (with the new EMAs) passes and it merges alone.
    push(0, 1)
    want = grace_window(ema_step, 0.0, 0.05, overlap_steps=2, safety=0.5, cap_s=10.0)
    assert state.fragments[0].grace_s == pytest.approx(want)
    clock.t += want + 1e-6
    state.tick()
    assert state.fragments[0].version == 2
    record = state.merge_log[-1]
    assert record["learners"] == [0]
    np.testing.assert_allclose(
        [record["ema_step_s"], record["ema_quorum_s"], record["ema_sync_s"]], [ema_step, 0, 0.05]
    )
    assert record["waited_s"] >= record["grace_s"]


@pytest.mark.multiprocess
def test_status_cli_shows_learners_and_fragments(syncer):
    import os
    import pathlib
    import subprocess
    import sys

    server, client = syncer
    client.register(0, server.fingerprint, "2x1")
    client.heartbeat(learner_id=0, step=7, loss=3.5, state="training", versions=[0, 0])
    root = pathlib.Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "decoupled_diloco.status", f"--syncer=127.0.0.1:{server.port}"]
    env = {**os.environ, "DD_RUN_TOKEN": TOKEN}
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2x1" in out.stdout and "3.500" in out.stdout and "merges 0" in out.stdout
    env["DD_RUN_TOKEN"] = "wrong"
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "UNAUTHENTICATED" in out.stderr


def test_tls_syncer_serves_tls_clients_only(tmp_path):
    import dataclasses
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; it only makes the test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
    )
    config = _config(
        **{"decoupled.syncer.tls_cert": str(cert), "decoupled.syncer.tls_key": str(key)}
    )
    server = SyncerServer(config, host="127.0.0.1", port=0, token=TOKEN).start()
    try:
        tls = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
        assert tls.status()["merges"] == 0
        tls.close()
        plain_config = dataclasses.replace(
            config.decoupled.syncer, tls_cert="", tls_key="", retries=0, rpc_timeout_s=5.0
        )
        plain = SyncerClient(f"127.0.0.1:{server.port}", plain_config, TOKEN)
        with pytest.raises(grpc.RpcError) as info:
            plain.status()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        plain.close()
    finally:
        server.stop(0)


def test_client_retries_until_the_syncer_is_up_and_the_push_counts_once():
    import dataclasses
    import threading
    import time

    from decoupled_diloco.local.procs import free_port
    from decoupled_diloco.syncer.server import initial_fragments

    config = _config(**{"decoupled.quorum": 2})
    port = free_port()
    transport = dataclasses.replace(config.decoupled.syncer, retries=12, rpc_timeout_s=5.0)
    client = SyncerClient(f"127.0.0.1:{port}", transport, TOKEN)
    cut, _ = initial_fragments(config)
    specs, delta = cut[0], _deltas(cut[0], 1)
    with pytest.raises(grpc.RpcError) as info:  # Nobody listens yet, and no retries here.
        client._call(lambda: client.stub.Status(pb.StatusRequest(), timeout=2), retries=0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    replies = []
    pusher = threading.Thread(target=lambda: replies.append(_push(client, specs, delta)))
    pusher.start()
    deadline = time.monotonic() + 30
    while client.retries_done < 1:  # the push has failed at least once and is backing off
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server = SyncerServer(config, host="127.0.0.1", port=port, token=TOKEN)
    # Register both learners first thing, so the retried push finds learner 0 known.
    server.state.register(0, "1x1")
    server.state.register(1, "1x1")
    server.start()
    try:
        pusher.join(timeout=60)
        assert replies and replies[0].accepted and not replies[0].duplicate
        again = _push(client, specs, delta)  # the same (learner, fragment, round) once more
        assert again.duplicate and server.state.status()["fragments"][0]["pending"] == [0]
    finally:
        client.close()
        server.stop(0)


@pytest.mark.parametrize(
    "syncer",
    [
        {
            "decoupled.quorum": 1,
            "decoupled.partial_merge": "share",
            "outer.lr": 1.0,
            "outer.momentum": 0.0,
            "outer.nesterov": False,
        }
    ],
    indirect=True,
)
def test_share_merge_of_one_learner_of_two_moves_half_way(syncer):
    """partial_merge="share": a merge holding 1 of the 2 learners steps by 1/2 of its delta."""
    server, client = syncer
    specs, anchor = _two_learners_on_fragment_0(server, client)
    d0 = _deltas(specs, 1)
    _push(client, specs, d0, learner=0, fragment=0)
    version, got = client.pull(0, 0, min_version=1, wait_s=10)
    assert version == 1 and client.status()["merge_log"][-1]["learners"] == [0]
    for a, x, g in zip(anchor, d0, got, strict=True):
        np.testing.assert_allclose(g, a - 0.5 * x, rtol=2e-5, atol=2e-7)


def test_a_silent_learner_leaves_the_quorum_after_learner_timeout():
    from decoupled_diloco.syncer.records import Push
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    config = _config(**{"decoupled.quorum": 2, "decoupled.syncer.learner_timeout_s": 5.0})
    cut, values = initial_fragments(config)
    clock = _Clock()
    state = SyncerState(config, cut, values, clock=clock)
    for i in (0, 1):
        state.register(i, "1x1")
    specs = state.fragments[0].specs
    assert state.push(Push(0, 0, 0, 0, 4, 1024, _deltas(specs, 0))).accepted
    clock.t += 4.0
    state.heartbeat(0, step=4)  # learner 0 keeps talking; learner 1 has gone silent
    state.tick()
    assert state.fragments[0].version == 0  # learner 1 still counts: quorum 2 not reached
    clock.t += 1.5  # learner 1 silent for 5.5 s > learner_timeout_s
    assert state.live_learners(clock()) == [0]
    state.tick()
    assert state.fragments[0].version == 1 and state.merge_log[-1]["learners"] == [0]
    state.heartbeat(1, step=1)  # back: it counts again
    assert state.live_learners(clock()) == [0, 1]


# A client built from syncer.proto alone (grpc_tools), in a fresh interpreter that never imports
# the package: what any outside implementation would send.
_PROTO_CLIENT = r"""
import pathlib, sys
import grpc
from grpc_tools import protoc
out, proto = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
assert protoc.main(["protoc", f"-I{proto.parent}", f"--python_out={out}",
                    f"--grpc_python_out={out}", str(proto)]) == 0
sys.path.insert(0, str(out))
import syncer_pb2 as pb, syncer_pb2_grpc as pb_grpc
stub = pb_grpc.SyncerStub(grpc.insecure_channel(sys.argv[3]))
meta = (("x-dd-run-token", sys.argv[4]),)
for learner in (int(sys.argv[5]), -1):
    try:
        stub.Register(pb.RegisterRequest(learner_id=learner, fingerprint=sys.argv[6]),
                      metadata=meta, timeout=30)
        print("OK")
    except grpc.RpcError as error:
        print(error.code().name, error.details())
"""


@pytest.mark.multiprocess
def test_register_refuses_learner_ids_outside_max_learners_from_a_proto_client(syncer, tmp_path):
    import pathlib
    import subprocess
    import sys

    from decoupled_diloco.comm import wire as wire_lib
    from decoupled_diloco.config import max_learners

    server, client = syncer
    proto = pathlib.Path(wire_lib.__file__).with_name("syncer.proto")
    num = max_learners(server.state.config)  # ids beyond num_learners may join, up to it
    args = [str(tmp_path), str(proto), f"127.0.0.1:{server.port}", TOKEN, str(num)]
    out = subprocess.run(
        [sys.executable, "-c", _PROTO_CLIENT, *args, server.fingerprint],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        f"INVALID_ARGUMENT learner id {num} is not in [0, {num}) (decoupled.max_learners)",
        f"INVALID_ARGUMENT learner id -1 is not in [0, {num}) (decoupled.max_learners)",
    ]
    assert server.state.learners == {}  # nothing registered


def test_a_learner_claiming_tiny_steps_cannot_shrink_the_others_h():
    """DyLU scales every learner's H by the fastest step time: the syncer floors each claim at
    half the pace it saw in that learner's heartbeats (steps over its own clock)."""
    from decoupled_diloco.syncer.records import PACE_WINDOW_S
    from decoupled_diloco.syncer.server import initial_fragments
    from decoupled_diloco.syncer.state import SyncerState

    config = _config()
    cut, values = initial_fragments(config)
    clock = _Clock()
    state = SyncerState(config, cut, values, clock=clock)
    for i in (0, 1):
        state.register(i, "1x1")
    # Both step once a second; learner 1 claims a microsecond per step.
    for t in range(int(3 * PACE_WINDOW_S) + 1):
        state.heartbeat(0, step=t, step_time_s=1.0)
        state.heartbeat(1, step=t, step_time_s=1e-6)
        clock.t += 1.0
        if t < PACE_WINDOW_S:  # before the syncer has seen a window, the claim is all it has
            assert state.fastest_step_time() == pytest.approx(1e-6)
    assert state.fastest_step_time() == pytest.approx(0.5)  # half its real pace, not 1e-6
    # An honest claim is what counts (it is above half the pace seen): 0.8 s of 1 s per step.
    state.heartbeat(1, step=int(3 * PACE_WINDOW_S) + 1, step_time_s=0.8)
    assert state.fastest_step_time() == pytest.approx(0.8)
    # A restart measures its pace afresh.
    state.register(1, "1x1")
    state.heartbeat(1, step=0, step_time_s=1e-6)
    assert state.fastest_step_time() == pytest.approx(1e-6)
