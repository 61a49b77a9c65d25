"""Compressed payloads on the wire: header checks, fuzzing, the syncer, downlink, EF checkpoint."""

import functools
import json

import grpc
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import wire
from decoupled_diloco.comm.client import SyncerClient
from decoupled_diloco.core import compression as C
from decoupled_diloco.core import fragments as F
from decoupled_diloco.learner.learner import Learner
from decoupled_diloco.learner.recovery import LearnerCheckpoints
from decoupled_diloco.syncer.server import SyncerServer
from tests.conftest import tiny_config
from tests.helpers import assert_budget_trained_once, to_bytes

TOKEN = "test-token"
SPECS = [
    F.TensorSpec(0, "a", (7, 9), "float32"),
    F.TensorSpec(1, "b", (130,), "float32"),
    F.TensorSpec(2, "c", (1,), "float32"),
]
CODECS = [
    C.Codec("none"),
    C.Codec("bf16"),
    C.Codec("int8", 16),
    C.Codec("int4", 16),
    C.Codec("e3m0", 16),
    C.Codec("topk", 32, "int4", 3),
    C.Codec("topk", 32, "none", 2),
]


def _encode(arrays, specs, codec):
    """Headers and payload bytes of `arrays` as the learner sends them (jit-compiled encode)."""
    sections = jax.device_get(_encoder(codec)([a.reshape(-1) for a in arrays]))
    return wire.headers(specs, codec), to_bytes(wire.encoded_arrays(sections, specs, codec))


@functools.cache
def _encoder(codec):
    return jax.jit(lambda xs: [C.encode(x, codec) for x in xs])


@functools.cache
def _valid(codec, seed):
    """A valid encoded payload of SPECS (cached: the fuzzer mutates copies of it)."""
    tensors, payload = _encode(_arrays(seed), SPECS, codec)
    return [t.SerializeToString() for t in tensors], payload


def _arrays(seed=0, specs=SPECS):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s.shape).astype(np.float32) for s in specs]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.scheme}-{c.values}")
def test_encoded_payload_round_trips_through_the_wire_checks(codec):
    arrays = _arrays()
    tensors, payload = _encode(arrays, SPECS, codec)
    assert wire.check_headers(tensors, SPECS) == len(payload)
    got = wire.decode_payload(payload, tensors, SPECS)
    sections = jax.device_get(_encoder(codec)([a.reshape(-1) for a in arrays]))
    for g, a, s, e in zip(got, arrays, SPECS, sections, strict=True):
        assert g.shape == s.shape and g.dtype == np.float32
        np.testing.assert_array_equal(g.reshape(-1), C.decode(e, a.size, codec))


def test_every_header_field_is_checked_against_the_model():
    codec = C.Codec("int4", 16)
    tensors, payload = _encode(_arrays(), SPECS, codec)

    def refused(text, **fields):
        bad = [pb.TensorHeader() for _ in tensors]
        for b, t in zip(bad, tensors, strict=True):
            b.CopyFrom(t)
        for name, value in fields.items():
            setattr(bad[1], name, value)
        with pytest.raises(wire.PayloadError, match=text):
            wire.check_headers(bad, SPECS)

    refused("format version 0", format_version=0)
    refused("format version 2", format_version=2)
    refused("unknown scheme", scheme="int3")
    refused("block size", block_size=0)
    refused("block size must be 0", scheme="bf16")
    refused("value scheme and k", topk_k=3)
    refused("header says", payload_bytes=tensors[1].payload_bytes - 1)
    refused("topk: k=40", scheme="topk", values_scheme="int4", topk_k=40, block_size=16)
    refused("expected dtype", dtype="float16")
    with pytest.raises(wire.PayloadError, match="payload has"):
        wire.decode_payload(payload[:-1], tensors, SPECS)


def _content_refused(codec, mutate, text):
    tensors, payload = _encode(_arrays(), SPECS, codec)
    raw = bytearray(payload)
    mutate(raw, tensors)
    with pytest.raises(wire.PayloadError, match=text):
        wire.decode_payload(bytes(raw), tensors, SPECS)


def test_bad_content_is_refused_with_a_clear_error():
    nan = np.array([np.nan], np.float32).tobytes()
    neg = np.array([-1.0], np.float32).tobytes()
    # The first bytes of tensor "a" are its first block scale.
    _content_refused(C.Codec("int8", 16), lambda r, t: r.__setitem__(slice(0, 4), nan), "scales")
    _content_refused(C.Codec("e3m0", 16), lambda r, t: r.__setitem__(slice(0, 4), neg), "scales")
    # topk: swap the first chunk's first two indices (no longer ascending), or point past it.
    swap = np.array([2, 1], np.uint16).tobytes()
    _content_refused(
        C.Codec("topk", 32, "none", 2), lambda r, t: r.__setitem__(slice(0, 4), swap), "ascending"
    )
    far = np.array([0, 40], np.uint16).tobytes()
    _content_refused(
        C.Codec("topk", 32, "none", 2), lambda r, t: r.__setitem__(slice(0, 4), far), "ascending"
    )
    inf = np.array([np.inf], np.float32).tobytes()
    _content_refused(C.Codec("none"), lambda r, t: r.__setitem__(slice(0, 4), inf), "non-finite")
    big = np.array([3e38], np.float32).tobytes()

    def overflow(raw, tensors):  # a finite scale whose int4 code -8 overflows when decoded
        raw[0:4] = big
        raw[4 * 4] = 0  # tensor "a": 4 block scales, then packed codes; nibble 0 is -8

    _content_refused(C.Codec("int4", 16), overflow, "non-finite")


@st.composite
def _payloads(draw):
    codec = draw(st.sampled_from(CODECS))
    headers, payload = _valid(codec, draw(st.integers(0, 2)))
    tensors = [pb.TensorHeader.FromString(h) for h in headers]
    raw = bytearray(payload)
    kind = draw(st.sampled_from(["flip", "random", "truncate", "header"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.integers(0, 255))
    elif kind == "random":
        raw = bytearray(draw(st.binary(min_size=0, max_size=len(raw) + 8)))
    elif kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw)))]
    else:
        i = draw(st.integers(0, len(tensors) - 1))
        field = draw(st.sampled_from(["scheme", "block_size", "topk_k", "payload_bytes"]))
        value = {
            "scheme": draw(st.sampled_from(["none", "bf16", "int8", "int4", "e3m0", "topk", ""])),
            "block_size": draw(st.integers(-1, 70000)),
            "topk_k": draw(st.integers(-1, 40)),
            "payload_bytes": draw(st.integers(-1, 2000)),
        }[field]
        setattr(tensors[i], field, value)
    return tensors, bytes(raw)


@hypothesis.settings(max_examples=100, deadline=None, derandomize=True)
@hypothesis.given(_payloads())
def test_fuzzed_payloads_decode_fully_or_fail_with_a_payload_error(case):
    tensors, raw = case
    try:
        wire.check_headers(tensors, SPECS)
        got = wire.decode_payload(raw, tensors, SPECS)
    except wire.PayloadError as error:
        assert str(error)  # a message, naming the problem
        return
    # Accepted: every tensor complete, of its shape and dtype, finite.
    assert [g.shape for g in got] == [s.shape for s in SPECS]
    assert all(g.dtype == np.float32 and np.isfinite(g).all() for g in got)


# Over gRPC ---------------------------------------------------------------------------------


@pytest.fixture
def syncer(request):
    overrides = {
        "decoupled.fragments": 2,
        "decoupled.quorum": 1,
        "decoupled.syncer.max_grace_s": 0.0,
        "outer.lr": 1.0,
        "outer.momentum": 0.0,
        "outer.nesterov": False,
        "outer.merge": "mean",
        "decoupled.partial_merge": "mean",  # a merge of one learner steps all the way
        "compression.scheme": "e3m0",
        "compression.block_size": 64,
        **getattr(request, "param", {}),
    }
    config = tiny_config(mode="decoupled", **overrides)
    server = SyncerServer(config, host="127.0.0.1", port=0, token=TOKEN).start()
    client = SyncerClient(f"127.0.0.1:{server.port}", config.decoupled.syncer, TOKEN)
    client.register(0, server.fingerprint)
    yield server, client
    client.close()
    server.stop(0)


def _push(client, specs, tensors, arrays, rnd=0):
    return client.push(
        learner_id=0,
        fragment=0,
        round=rnd,
        base_version=0,
        steps=4,
        tokens=1024,
        specs=specs,
        arrays=arrays,
        tensors=tensors,
    )


def test_syncer_merges_what_was_encoded_and_refuses_bad_payloads_untouched(syncer):
    server, client = syncer
    frag = server.state.fragments[0]
    specs, before = frag.specs, [v.copy() for v in frag.values]
    codec = C.Codec("e3m0", 64)
    delta = [0.1 * a for a in _arrays(1, specs)]  # an outer gradient's size (norm bound)
    tensors, payload = _encode(delta, specs, codec)
    # Bad: a NaN block scale in the last tensor; nothing of the push may be applied.
    bad = bytearray(payload)
    last = sum(t.payload_bytes for t in tensors[:-1])
    bad[last : last + 4] = np.array([np.nan], np.float32).tobytes()
    with pytest.raises(grpc.RpcError) as info:
        _push(client, specs, tensors, [np.frombuffer(bytes(bad), np.uint8)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "scales" in info.value.details() and specs[-1].name in info.value.details()
    wrong = [pb.TensorHeader() for _ in tensors]
    for w, t in zip(wrong, tensors, strict=True):
        w.CopyFrom(t)
    wrong[0].format_version = 9
    with pytest.raises(grpc.RpcError) as info:
        _push(client, specs, wrong, [np.frombuffer(payload, np.uint8)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "format version 9" in info.value.details()
    assert frag.version == 0 and not frag.pending
    for v, b in zip(frag.values, before, strict=True):
        np.testing.assert_array_equal(v, b)
    # Good: the merge (quorum 1, SGD lr 1, plain mean) is Θ − decoded Δ.
    assert _push(client, specs, tensors, [np.frombuffer(payload, np.uint8)]).accepted
    version, got = client.pull(-1, 0, 1, 10.0)
    decoded = wire.decode_payload(payload, tensors, specs)
    assert version == 1
    for g, b, d in zip(got, before, decoded, strict=True):
        np.testing.assert_allclose(g, b - d, rtol=1e-6, atol=1e-7)
    assert client.bytes_sent > len(payload) and client.last_bytes() > 0


@pytest.mark.parametrize("syncer", [{"compression.downlink": True}], indirect=True)
def test_downlink_sends_differences_from_the_learners_copy_without_drift(syncer):
    server, client = syncer
    frag = server.state.fragments[0]
    specs = frag.specs
    full = sum(s.nbytes for s in specs)
    version, copy = client.pull(0, 0, 0, 10.0)  # no copy yet: full values
    assert version == 0 and client.last_bytes() > full
    codec = C.Codec("e3m0", 64)
    for rnd in range(3):
        tensors, payload = _encode([0.1 * a for a in _arrays(10 + rnd, specs)], specs, codec)
        raw = [np.frombuffer(payload, np.uint8)]
        assert client.push(
            learner_id=0,
            fragment=0,
            round=rnd,
            base_version=version,
            steps=4,
            tokens=1024,
            specs=specs,
            arrays=raw,
            tensors=tensors,
        ).accepted
        before = copy
        version, copy = client.pull(0, 0, version + 1, 10.0, have=(version, copy))
        assert client.last_bytes() < full / 4  # a 4-bit difference, not the values
        held = server.service.downlink.copies[(0, 0)][version]
        for c, h, true, b in zip(copy, held, frag.values, before, strict=True):
            np.testing.assert_array_equal(c, h)  # the learner holds what the syncer thinks
            # Within one encoding of the difference d = Θ − copy: e3m0's error per element is
            # at most |d|/3 where |d| ≥ s/64 and s/128 below (s: the block's absmax of |d|).
            d = (true.astype(np.float64) - b).reshape(-1)
            blocks = np.pad(np.abs(d), (0, -d.size % 64)).reshape(-1, 64)
            scale = np.repeat(blocks.max(axis=1), 64)[: d.size]
            bound = np.where(np.abs(d) >= scale / 64, np.abs(d) / 3, scale / 128)
            err = np.abs(true.astype(np.float64) - c).reshape(-1)
            assert (err <= bound + 1e-6 * (np.abs(d) + scale) + 1e-30).all()
        # The evaluator (learner id -1) always gets the exact values.
        _, exact = client.pull(-1, 0, version, 10.0)
        for e, true in zip(exact, frag.values, strict=True):
            np.testing.assert_array_equal(e, true)


class _Batches:
    """The data iterator's checkpointed state (not under test here)."""

    def get_state(self):
        return {"next_index": 0}

    def set_state(self, state):
        assert state == {"next_index": 0}


def test_learner_restored_from_its_checkpoint_continues_with_the_same_residual(tmp_path):
    config = tiny_config(
        mode="decoupled",
        **{
            "compression.scheme": "topk",
            "compression.block_size": 64,
            "compression.density": 0.05,
            "compression.error_feedback": True,
        },
    )

    def learner():
        made = Learner(config, 0, "127.0.0.1:1", token=TOKEN)  # never connects
        state = made.island.init(0)
        host = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state.params))]
        for fragment, frag in zip(made.sync.states, made.sync.partition, strict=True):
            fragment.anchor = F.gather(host, frag)
        return made, state

    def params(seed, state, made):
        leaves = [
            x + 0.01 * jax.random.normal(jax.random.key(seed + i), x.shape)
            for i, x in enumerate(jax.tree.leaves(state.params))
        ]
        return F.gather(leaves, made.sync.partition[0])

    first, state = learner()
    for seed in (1, 2):  # two rounds: the residual holds what topk left out
        first.sync.encoder.encode(0, first.sync.states[0].anchor, params(seed, state, first))
    saved = [np.asarray(x) for x in jax.tree.leaves(first.sync.encoder.residual)]
    assert any(np.abs(x).max() > 0 for x in saved)
    checkpoints = LearnerCheckpoints(tmp_path / "learner_0", every=1)
    checkpoints.save(first, state, _Batches())
    checkpoints.close()

    second, state2 = learner()
    assert all(
        np.abs(np.asarray(x)).max() == 0 for x in jax.tree.leaves(second.sync.encoder.residual)
    )
    restarted = LearnerCheckpoints(tmp_path / "learner_0", every=1)
    restarted.restore(second, state2, _Batches())
    restarted.close()
    for a, b in zip(saved, jax.tree.leaves(second.sync.encoder.residual), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # The next round encodes the same bytes and leaves the same residual in both.
    one = first.sync.encoder.encode(0, first.sync.states[0].anchor, params(3, state, first))
    two = second.sync.encoder.encode(0, second.sync.states[0].anchor, params(3, state, second))
    for a, b in zip(one.arrays, two.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(
        jax.tree.leaves(first.sync.encoder.residual),
        jax.tree.leaves(second.sync.encoder.residual),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.multiprocess
def test_compressed_decoupled_run_trains_and_accounts_its_bytes(tmp_path):
    """Real syncer and learner processes: e3m0 with error feedback both ways (downlink)."""
    from tests.test_decoupled import _children_of, _cleanup, _launch

    proc = _launch(
        tmp_path,
        "--config.train_steps=32",
        "--config.compression.scheme=e3m0",
        "--config.compression.error_feedback=True",
        "--config.compression.downlink=True",
    )
    try:
        out, _ = proc.communicate(timeout=600)  # generous: a busy shared machine
        assert proc.returncode == 0, out[-3000:]
        summary = json.loads((tmp_path / "summary.json").read_text())
        # Learned something (ln(256) = 5.55 at init); how much depends on how many merges came
        # back before the learners finished, which a busy machine delays.
        assert summary["final_eval_loss"] < 5.0
        learners = summary["learners"]
        assert_budget_trained_once(summary, learners=2)
        assert all(x["compression"] == "e3m0" and x["rounds"] for x in learners)
        assert summary["outer_syncs"] >= 2
        # Every push round is counted; pushes are 4-bit: under 1/6 of float32 per round.
        params = summary["params"]
        for x in learners:
            assert sum(r["sent"] for r in x["rounds"]) <= x["bytes_sent"]
            assert all(0 < r["sent"] < 4 * params / 6 for r in x["rounds"])
        assert summary["bytes_sent"] == sum(x["bytes_sent"] for x in learners)
        # M=2: 2(M-1)/M = 1 float32 per parameter and step. On data leases the steps are the
        # budget's plus those trained again (batches of pushes refused as late).
        steps = sum(x["steps"] for x in learners)
        assert steps >= 2 * 32 and summary["dp_equivalent_bytes"] == steps * 4 * params
        assert summary["bytes_sent"] < summary["dp_equivalent_bytes"] / 20
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert lines[-1]["learner_bytes_sent"] == [x["bytes_sent"] for x in learners]
        assert _children_of(tmp_path) == []
    finally:
        _cleanup(proc, tmp_path)


@pytest.mark.parametrize("lie", ["total_bytes", "extra_chunk"])
def test_a_pull_reply_larger_than_its_headers_is_refused(lie):
    """A (hostile or broken) syncer's pull reply is read into a buffer sized from its headers."""
    from concurrent import futures

    from decoupled_diloco.comm import syncer_pb2_grpc

    specs = [F.TensorSpec(0, "w", (4, 4), "float32")]
    data = np.ones((4, 4), np.float32).tobytes()

    class Lying(syncer_pb2_grpc.SyncerServicer):
        def Pull(self, request, context):  # noqa: N802 - the generated servicer's name
            total = len(data) * (2 if lie == "total_bytes" else 1)
            yield pb.FragmentChunk(
                fragment=0, version=1, tensors=wire.headers(specs), total_bytes=total, data=data
            )
            if lie == "extra_chunk":
                yield pb.FragmentChunk(data=data)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    syncer_pb2_grpc.add_SyncerServicer_to_server(Lying(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = SyncerClient(f"127.0.0.1:{port}", tiny_config().decoupled.syncer, TOKEN)
    try:
        message = "reply of 128 bytes" if lie == "total_bytes" else "more than 64 bytes"
        with pytest.raises(wire.PayloadError, match=message):
            client.pull(0, 0, 1, 1.0)
    finally:
        client.close()
        server.stop(0)
