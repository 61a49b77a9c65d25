"""Compression: error bounds per scheme, scheme shapes, error feedback, numpy/jax agreement."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco import config as config_lib
from decoupled_diloco.core import compression as C

TINY = np.float32(np.finfo(np.float32).tiny)
CODECS = {
    "none": C.Codec("none"),
    "bf16": C.Codec("bf16"),
    "int8": C.Codec("int8", 64),
    "int4": C.Codec("int4", 64),
    "e3m0": C.Codec("e3m0", 64),
    "topk": C.Codec("topk", 100, "none", 7),
    "topk_int4": C.Codec("topk", 100, "int4", 7),
    "topk_e3m0": C.Codec("topk", 100, "e3m0", 7),
}


def _tensors():
    """Random and adversarial tensors (1000 elements: a partial last block everywhere)."""
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(1000).astype(np.float32)
    huge = normal.copy()
    huge[123] = 3e38  # one value near the float32 maximum
    denormal = (rng.standard_normal(1000) * 1e-40).astype(np.float32)
    negzero = np.where(rng.random(1000) < 0.5, -0.0, normal).astype(np.float32)
    mixed = normal * np.float32(1e-3)
    mixed[::97] = -0.0
    return {
        "normal": normal,
        "zeros": np.zeros(1000, np.float32),
        "negative_zeros": np.full(1000, -0.0, np.float32),
        "one_huge": huge,
        "denormals": denormal,
        "half_negative_zero": negzero,
        "mixed_scales": mixed,
    }


@functools.cache
def _encoder(codec):
    return jax.jit(lambda v: C.encode(v, codec))


def _round_trip(x, codec):
    sections = jax.device_get(_encoder(codec)(x))
    sections = {k: np.asarray(v) for k, v in sections.items()}
    for name, dtype, count in C.layout(codec, x.size):  # the layout the wire relies on
        assert sections[name].dtype == dtype and sections[name].size == count, name
    return sections, C.decode(sections, x.size, codec)


def _block_absmax(x, block):
    nb = -(-x.size // block)
    padded = np.zeros(nb * block, np.float32)
    padded[: x.size] = np.abs(x)
    return np.repeat(padded.reshape(nb, block).max(axis=1), block)[: x.size]


@pytest.mark.parametrize("tensor", list(_tensors()))
@pytest.mark.parametrize("scheme", ["none", "bf16", "int8", "int4", "e3m0"])
def test_round_trip_error_bounds(scheme, tensor):
    x = _tensors()[tensor]
    codec = CODECS[scheme]
    _, got = _round_trip(x, codec)
    assert got.shape == x.shape and got.dtype == np.float32 and np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    ax = np.abs(x).astype(np.float64)
    # float32 rounding of the scale arithmetic, plus flush-to-zero of denormals on XLA:CPU.
    slack = 1e-6 * ax + 2 * TINY
    if scheme == "none":
        bound = np.zeros_like(ax)
    elif scheme == "bf16":
        bound = ax * 2.0**-8
    else:
        s = _block_absmax(x, codec.block_size).astype(np.float64)
        bound = {"int8": s / 254, "int4": s / 14, "e3m0": ax / 3 + s / 128}[scheme]
        slack += 1e-6 * s
    assert (err <= bound + slack).all(), (scheme, tensor, float((err - bound).max()))
    if tensor == "zeros" or tensor == "negative_zeros":
        assert (got == 0).all()


def test_e3m0_decodes_to_signed_powers_of_two_times_the_block_scale():
    x = _tensors()["normal"]
    codec = CODECS["e3m0"]
    sections, got = _round_trip(x, codec)
    scale = np.repeat(sections["scales"], codec.block_size)[: x.size]
    ratio = got / scale
    allowed = {0.0} | {s * 2.0**e for s in (1, -1) for e in range(-6, 1)}
    assert set(np.unique(ratio).tolist()) <= allowed
    # Each block's largest magnitude is sent exactly; signs survive.
    assert np.isin(np.abs(x), sections["scales"]).sum() >= len(sections["scales"])
    nonzero = got != 0
    assert (np.sign(got[nonzero]) == np.sign(x[nonzero])).all()


@pytest.mark.parametrize("scheme", ["topk", "topk_int4", "topk_e3m0"])
def test_topk_keeps_the_largest_entries_of_each_chunk(scheme):
    x = _tensors()["normal"]
    codec = CODECS[scheme]
    _, got = _round_trip(x, codec)
    for start in range(0, x.size, codec.block_size):
        chunk, dec = x[start : start + codec.block_size], got[start : start + codec.block_size]
        k = min(codec.k, chunk.size)
        largest = set(np.argsort(-np.abs(chunk), kind="stable")[:k].tolist())
        assert set(np.flatnonzero(dec).tolist()) <= largest
        if codec.values == "none":
            assert set(np.flatnonzero(dec).tolist()) == largest
            np.testing.assert_array_equal(dec[list(largest)], chunk[list(largest)])


@pytest.mark.parametrize("scheme", list(CODECS))
def test_jax_and_numpy_decode_agree_bit_for_bit(scheme):
    """The learner's residual (jax decode) counts exactly what the syncer decodes (numpy)."""
    x = _tensors()["mixed_scales"]
    codec = CODECS[scheme]
    sections, got = _round_trip(x, codec)
    on_device = jax.jit(lambda s: C.decode(s, x.size, codec, xp=jnp))(sections)
    np.testing.assert_array_equal(np.asarray(on_device), got)


def test_error_feedback_keeps_the_running_sums_close():
    """Σ decoded − Σ true = −residual: bounded with error feedback, drifting without it."""
    codec = C.Codec("topk", 128, "int4", 4)  # 3% density, int4 values: a lossy 2-bit class
    rng = np.random.default_rng(1)
    shape, rounds = (16, 64), 200
    encode = jax.jit(lambda a, x, r: C.encode_fragment(a, x, r, codec))
    plain = jax.jit(lambda a, x: C.encode_fragment(a, x, None, codec))
    residual = [jnp.zeros(shape, jnp.float32)]
    true_sum = np.zeros(shape)
    ef_sum, plain_sum = np.zeros(shape), np.zeros(shape)
    worst = 0.0
    for _ in range(rounds):
        # A persistent direction plus noise, like outer gradients of consecutive rounds.
        g = (0.5 + rng.standard_normal(shape)).astype(np.float32)
        anchor, local = [g], [jnp.zeros(shape, jnp.float32)]  # Δ = anchor − local = g
        sections, residual = encode(anchor, local, residual)
        ef_sum += C.decode(jax.device_get(sections[0]), g.size, codec).reshape(shape)
        sections, _ = plain(anchor, local)
        plain_sum += C.decode(jax.device_get(sections[0]), g.size, codec).reshape(shape)
        true_sum += g
        np.testing.assert_allclose(ef_sum + np.asarray(residual[0]), true_sum, atol=1e-3)
        worst = max(worst, float(np.abs(ef_sum - true_sum).max()))
    drift = float(np.abs(plain_sum - true_sum).max())
    # Bounded: a residual entry is sent once it is among its chunk's largest; it never grows
    # with the number of rounds (here ~ chunk/k rounds of |g| at most).
    assert worst < 0.25 * rounds * 0.5, worst
    assert float(np.abs(ef_sum - true_sum).max()) < drift / 4, (worst, drift)


def test_error_feedback_decay_scales_the_residual_before_it_is_added():
    """ef_decay β: the encoded value is Δ + β·residual (SparseLoCo's decaying accumulator)."""
    codec = C.Codec("topk", 4, "none", 1)  # one entry of each 4 sent, exactly
    anchor = [jnp.asarray([4.0, 1.0, 0.0, 0.0])]
    local = [jnp.zeros(4, jnp.float32)]
    residual = [jnp.asarray([0.0, 2.0, 3.0, 0.0])]
    sections, new = C.encode_fragment(anchor, local, residual, codec, decay=0.5)
    # Δ + 0.5·r = [4, 2, 1.5, 0]: 4 is sent, the rest stays.
    np.testing.assert_allclose(C.decode(jax.device_get(sections[0]), 4, codec), [4, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(new[0]), [0.0, 2.0, 1.5, 0.0])


def test_codec_from_config_and_payload_sizes():
    z = config_lib.CompressionConfig(scheme="topk", block_size=4096, density=0.02)
    codec = C.codec_for(z)
    assert codec == C.Codec("topk", 4096, "int4", 82)
    n = 4096 * 10
    # 82 uint16 indices + 41 bytes of int4 codes + one float32 scale per chunk.
    assert C.nbytes(codec, n) == 10 * (82 * 2 + 41 + 4)
    assert C.nbytes(C.Codec("e3m0", 256), 1000) == 4 * 4 + 500
    assert C.nbytes(C.Codec("none"), 10, "bfloat16") == 20
    for bad in (
        C.Codec("int5", 64),
        C.Codec("int4", 0),
        C.Codec("bf16", 64),
        C.Codec("topk", 100, "int3", 5),
        C.Codec("topk", 100, "int4", 101),
        C.Codec("int8", 64, "int4", 0),
    ):
        with pytest.raises(C.CodecError):
            bad.check()


def test_config_validation_names_the_field():
    base = config_lib.ExperimentConfig()
    for field, value in (
        ("compression.scheme", "int3"),
        ("compression.topk_values", "fp8"),
        ("compression.density", 0.0),
        ("compression.block_size", 0),
    ):
        with pytest.raises(config_lib.ConfigError, match=field):
            config_lib.replace(base, **{field: value})
    with pytest.raises(config_lib.ConfigError, match="compression.block_size"):
        config_lib.replace(
            base, **{"compression.scheme": "topk", "compression.block_size": 1 << 17}
        )
    with pytest.raises(config_lib.ConfigError, match="compression.error_feedback"):
        config_lib.replace(base, **{"compression.error_feedback": True})
    int4 = config_lib.replace(base, **{"compression.scheme": "int4"})
    with pytest.raises(config_lib.ConfigError, match="compression.keep_unsent"):
        config_lib.replace(int4, **{"compression.keep_unsent": True})
    with pytest.raises(config_lib.ConfigError, match="compression.ef_decay"):
        config_lib.replace(int4, **{"compression.error_feedback": True, "compression.ef_decay": 0})
    with pytest.raises(config_lib.ConfigError, match="compression.ef_decay"):
        config_lib.replace(int4, **{"compression.ef_decay": 0.9})


def test_ring_allreduce_bytes():
    assert C.ring_allreduce_bytes(2, 1000) == 4000  # 2(M−1)/M = 1
    assert C.ring_allreduce_bytes(4, 1000) == 6000
    assert C.ring_allreduce_bytes(1, 1000) == 0


def test_dp_and_diloco_report_their_bytes_the_same_way(corpus, tmp_path):
    import json

    from decoupled_diloco.train import train_and_evaluate
    from tests.conftest import tiny_config

    for mode in ("dp", "diloco"):
        config = tiny_config(mode=mode, train_steps=8, inner_steps=4, **{"eval.every": 0})
        s = train_and_evaluate(config, tmp_path / mode, corpus=corpus).summary
        ring = C.ring_allreduce_bytes(2, s["params"])  # = 4 · params for M = 2
        assert s["dp_equivalent_bytes"] == 2 * 8 * ring
        want = s["dp_equivalent_bytes"] if mode == "dp" else 2 * s["outer_syncs"] * ring
        assert s["bytes_sent"] == s["bytes_received"] == want
        last = json.loads((tmp_path / mode / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["bytes_sent"] == want
    assert s["outer_syncs"] == 2 and s["bytes_sent"] == s["dp_equivalent_bytes"] // 4
