"""Outer-gradient compression: bf16, blockwise int8 / int4 / E3M0, chunk-wise top-k, error feedback.

Pure math on arrays, no I/O. `encode` (jax.numpy; the learner jit-compiles it on its own mesh)
turns one tensor into a few flat *sections* (scales, codes, indices); `decode` turns them back,
either in jax.numpy (the learner's error feedback) or in numpy (the syncer), with the same
arithmetic, so both ends agree on what was sent. `layout` lists a tensor's sections (name,
dtype, length) as a function of the codec and the element count alone: the wire format
(`comm/wire.py`) checks every length against it before it interprets a byte, and the numpy
`decode` checks the content (finite, non-negative scales; sorted, in-range top-k indices).

Schemes, on a tensor flattened to n elements and cut into blocks of `block_size` (the last one
zero-padded while computing; the padding is never sent):
- `none`: float32 values. `bf16`: bfloat16 values (round to nearest even).
- `int8` / `int4`: per block the absmax s, codes q = round(x / s · L) in [−L, L] with L = 127 / 7;
  decoded as q · (s · 1/L). Error ≤ s / (2L) per element. int4 codes are stored as q + 8 in a
  nibble, two per byte (low nibble first).
- `e3m0`: a 4-bit float with a sign bit and a 3-bit exponent e and no mantissa (Streaming
  DiLoCo's FP4): per block the absmax s; a value decodes to ±s · 2^(e − 7) for e ≥ 1 and to 0
  for e = 0, so the magnitudes are 0, s/64, ..., s/2, s. Encoding rounds |x| / s to the nearest
  of them (error ≤ |x| / 3 + s / 128).
- `topk`: per chunk of `block_size` entries the k largest by magnitude, as ascending uint16
  indices into the chunk plus their values coded by a value scheme (one scale per chunk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FORMAT_VERSION = 1  # of the per-tensor payload layout below; bump on any change
SCHEMES = ("none", "bf16", "int8", "int4", "e3m0", "topk")
VALUE_SCHEMES = ("none", "bf16", "int8", "int4", "e3m0")
_LEVELS = {"int8": 127, "int4": 7}
_F32 = np.dtype(np.float32)
# E3M0 magnitudes by exponent code (0 is zero); codes 8-15 are the negatives of 0-7.
_E3M0 = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], np.float32)
_E3M0_SIGNED = np.concatenate([_E3M0, -_E3M0]).astype(np.float32)


class CodecError(ValueError):
    """An encoding that cannot be decoded (bad field, length or content); the message says why."""


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one tensor is encoded (static: part of the wire header, not of the payload).

    Attributes:
      scheme: one of `SCHEMES`.
      block_size: elements per scale block (int8, int4, e3m0) or top-k chunk; 0 for none, bf16.
      values: topk only: the value scheme of the kept entries (one of `VALUE_SCHEMES`).
      k: topk only: entries kept per chunk, in [1, block_size].
    """

    scheme: str
    block_size: int = 0
    values: str = ""
    k: int = 0

    def check(self) -> None:
        """Raises CodecError naming the field that no encoder of this format would write."""
        if self.scheme not in SCHEMES:
            raise CodecError(f"unknown scheme {self.scheme!r} (known: {SCHEMES})")
        blockwise = self.scheme in ("int8", "int4", "e3m0", "topk")
        limit = 1 << 16 if self.scheme == "topk" else 1 << 24
        if blockwise and not 1 <= self.block_size <= limit:
            raise CodecError(f"{self.scheme}: block size {self.block_size} out of range")
        if not blockwise and self.block_size != 0:
            raise CodecError(f"{self.scheme}: block size must be 0, got {self.block_size}")
        if self.scheme == "topk":
            if self.values not in VALUE_SCHEMES:
                raise CodecError(f"topk: unknown value scheme {self.values!r}")
            if not 1 <= self.k <= self.block_size:
                raise CodecError(f"topk: k={self.k} not in [1, block size {self.block_size}]")
        elif self.values or self.k:
            raise CodecError(f"{self.scheme}: value scheme and k must be unset")

    def value_codec(self) -> Codec:
        """topk: the codec of the kept values (one block per chunk)."""
        blockwise = self.values in ("int8", "int4", "e3m0")
        return Codec(self.values, self.k if blockwise else 0)


def codec_for(config: Any) -> Codec:
    """The codec of a `CompressionConfig` (k = round(density · block_size), at least 1)."""
    scheme = config.scheme
    if scheme in ("none", "bf16"):
        return Codec(scheme)
    if scheme == "topk":
        k = min(max(1, round(config.density * config.block_size)), config.block_size)
        return Codec("topk", config.block_size, config.topk_values, k)
    return Codec(scheme, config.block_size)


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def layout(codec: Codec, n: int, dtype: Any = _F32) -> list[tuple[str, np.dtype, int]]:
    """The sections of an n-element tensor's payload, in wire order: (name, dtype, count).

    `dtype` is the tensor's own: scheme "none" sends it unchanged (raw values).
    """
    s = codec.scheme
    if s == "none":
        return [("values", np.dtype(dtype), n)]
    if s == "bf16":
        return [("values", np.dtype(np.uint16), n)]
    nb = _blocks(n, codec.block_size)
    if s == "int8":
        return [("scales", _F32, nb), ("codes", np.dtype(np.int8), n)]
    if s in ("int4", "e3m0"):
        return [("scales", _F32, nb), ("codes", np.dtype(np.uint8), -(-n // 2))]
    # topk: indices, then the value codec's sections over nb·k kept values.
    sub = [(f"values_{name}", dt, c) for name, dt, c in layout(codec.value_codec(), nb * codec.k)]
    return [("indices", np.dtype(np.uint16), nb * codec.k), *sub]


def nbytes(codec: Codec, n: int, dtype: Any = _F32) -> int:
    """Payload bytes of an n-element tensor of `dtype`."""
    return sum(dt.itemsize * count for _, dt, count in layout(codec, n, dtype))


# Encoding (jax.numpy; traced inside the learner's jit) ---------------------------------------


def _pad_blocks(x: jax.Array, block: int) -> jax.Array:
    n = x.shape[0]
    nb = _blocks(n, block)
    return jnp.pad(x, (0, nb * block - n)).reshape(nb, block)


def _pack4(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte, the first in the low nibble (odd counts padded with 0)."""
    codes = codes.astype(jnp.uint8)
    if codes.shape[0] % 2:
        codes = jnp.pad(codes, (0, 1))
    pairs = codes.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack4(packed: Any, n: int, xp: Any) -> Any:
    return xp.stack([packed & 15, packed >> 4], axis=-1).reshape(-1)[:n]


def _pow2(k: jax.Array) -> jax.Array:
    """2^k as float32 from its bits, exactly, for integer k in [-126, 127]."""
    return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


def _absmax_scaled(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per-block absmax scales and x / scale per block (0 where the block is all zero).

    The division goes through the scale's exponent: XLA may compute x / s as x · (1/s), and
    for s near the float32 maximum 1/s is denormal, which XLA:CPU flushes to zero.
    """
    xb = _pad_blocks(x, block)
    scales = jnp.max(jnp.abs(xb), axis=1)
    m, e = jnp.frexp(scales)  # s = m · 2^e with m in [0.5, 1)
    half = e // 2
    unit = xb * _pow2(-half)[:, None] * _pow2(half - e)[:, None]  # x / 2^e, in two exact steps
    r = jnp.where(scales[:, None] > 0, unit / jnp.where(m > 0, m, 1.0)[:, None], 0.0)
    return scales, r.reshape(-1)[: x.shape[0]]


def encode(x: jax.Array, codec: Codec) -> dict[str, jax.Array]:
    """Encodes a flat float32 tensor into its sections (see `layout`)."""
    x = x.reshape(-1).astype(jnp.float32)
    s = codec.scheme
    if s == "none":
        return {"values": x}
    if s == "bf16":
        return {"values": jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)}
    if s in _LEVELS:
        levels = _LEVELS[s]
        scales, r = _absmax_scaled(x, codec.block_size)
        q = jnp.clip(jnp.round(r * levels), -levels, levels).astype(jnp.int32)
        codes = q.astype(jnp.int8) if s == "int8" else _pack4(q + 8)
        return {"scales": scales, "codes": codes}
    if s == "e3m0":
        scales, r = _absmax_scaled(x, codec.block_size)
        mag = jnp.abs(r)
        m, ex = jnp.frexp(mag)  # mag = m · 2^ex, m in [0.5, 1): between 2^(ex-1) and 2^ex
        k = ex - 1 + (m >= 0.75).astype(ex.dtype)  # the nearest power of two is 2^k
        e = jnp.where(mag < 2.0**-7, 0, jnp.clip(k + 7, 1, 7))
        sign = jnp.signbit(x).astype(jnp.int32)
        return {"scales": scales, "codes": _pack4(e | (sign << 3))}
    # topk
    block, k = codec.block_size, codec.k
    xb = _pad_blocks(x, block)
    _, idx = jax.lax.top_k(jnp.abs(xb), k)
    idx = jnp.sort(idx, axis=1)
    kept = jnp.take_along_axis(xb, idx, axis=1).reshape(-1)
    sections = {"indices": idx.reshape(-1).astype(jnp.uint16)}
    for name, value in encode(kept, codec.value_codec()).items():
        sections[f"values_{name}"] = value
    return sections


# Decoding (numpy on the syncer, jax.numpy for the learner's residual) ------------------------


def _check_scales(scales: np.ndarray) -> None:
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(scales).all() and (scales >= 0).all()
    if not ok:
        raise CodecError("block scales must be finite and >= 0")


def decode(sections: dict[str, Any], n: int, codec: Codec, xp: Any = np) -> Any:
    """Decodes sections into a flat tensor of n elements (float32; "none": its own dtype).

    With `xp=np` the content is validated as well (scales finite and non-negative; top-k
    indices strictly ascending within each chunk and inside it; a finite result).

    Raises:
      CodecError: (numpy only) content no encoder would produce.
    """
    if xp is not np:
        return _decode(sections, n, codec, xp)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is refused just below
        out = _decode(sections, n, codec, xp)
        alarm = not np.isfinite(out.sum())
        if alarm and not np.isfinite(out).all():
            raise CodecError("decodes to non-finite values (NaN or infinity)")
    return out


def _decode(sections: dict[str, Any], n: int, codec: Codec, xp: Any) -> Any:
    s, f32 = codec.scheme, xp.float32
    if s == "none":
        return sections["values"]
    if s == "bf16":
        values = sections["values"]
        if xp is np:
            return values.view(ml_dtypes.bfloat16).astype(np.float32)
        return jax.lax.bitcast_convert_type(values, jnp.bfloat16).astype(jnp.float32)
    if s == "topk":
        return _decode_topk(sections, n, codec, xp)
    scales = sections["scales"]
    if xp is np:
        _check_scales(scales)
    block = codec.block_size
    if s in _LEVELS:
        step = scales * np.float32(1.0 / _LEVELS[s])
        q = sections["codes"] if s == "int8" else _unpack4(sections["codes"], n, xp)
        q = q.astype(xp.int32) - (0 if s == "int8" else 8)
        return q.astype(f32) * xp.repeat(step, block)[:n]
    codes = _unpack4(sections["codes"], n, xp).astype(xp.int32)
    return xp.asarray(_E3M0_SIGNED)[codes] * xp.repeat(scales, block)[:n]


def _decode_topk(sections: dict[str, Any], n: int, codec: Codec, xp: Any) -> Any:
    block, k = codec.block_size, codec.k
    nb = _blocks(n, block)
    idx = sections["indices"].reshape(nb, k).astype(xp.int32)
    if xp is np and (
        (k > 1 and not (np.diff(idx, axis=1) > 0).all()) or (idx.size and idx.max() >= block)
    ):
        raise CodecError("top-k indices must be strictly ascending within each chunk")
    sub = {name[len("values_") :]: v for name, v in sections.items() if name.startswith("values_")}
    kept = _decode(sub, nb * k, codec.value_codec(), xp)  # (numpy: checks its scales)
    flat = (idx + xp.arange(nb, dtype=xp.int32)[:, None] * block).reshape(-1)
    if xp is np:
        out = np.zeros(nb * block, np.float32)
        out[flat] = kept
    else:
        out = jnp.zeros(nb * block, jnp.float32).at[flat].set(kept)
    return out[:n]


# Fragments and error feedback ------------------------------------------------------------------


def encode_fragment(
    anchor: Sequence[jax.Array],
    local: Sequence[jax.Array],
    residual: Sequence[jax.Array] | None,
    codec: Codec,
    decay: float = 1.0,
) -> tuple[list[dict[str, jax.Array]], list[jax.Array] | None]:
    """Encodes a fragment's outer gradient Δ = anchor − local, with optional error feedback.

    With `residual` (error feedback), Δ + decay·residual is encoded and the new residual is
    what the encoding dropped: Δ + decay·residual − decode(encode(Δ + decay·residual)). With
    decay 1, the decoded outer gradients summed over rounds differ from the true ones by only
    the current residual.

    Returns:
      Each tensor's sections, and the new residual (None without error feedback).
    """
    sections, new_residual = [], [] if residual is not None else None
    for i, (a, x) in enumerate(zip(anchor, local, strict=True)):
        delta = (jnp.asarray(a, jnp.float32) - x.astype(jnp.float32)).reshape(-1)
        if residual is not None:
            delta = delta + decay * residual[i].reshape(-1).astype(jnp.float32)
        encoded = encode(delta, codec)
        sections.append(encoded)
        if new_residual is not None:
            sent = decode(encoded, delta.shape[0], codec, xp=jnp)
            new_residual.append((delta - sent).reshape(x.shape).astype(residual[i].dtype))
    return sections, new_residual


def flatten_sections(sections: dict[str, Any], codec: Codec, n: int) -> list[Any]:
    """A tensor's sections as arrays in wire order (`layout`)."""
    return [sections[name] for name, _, _ in layout(codec, n)]


# Accounting ---------------------------------------------------------------------------------


def ring_allreduce_bytes(num_learners: int, num_params: int, bytes_per_param: int = 4) -> int:
    """Bytes one learner sends (and receives) in a ring all-reduce of a full gradient.

    2(M − 1)/M · params · bytes: the reduce-scatter and the all-gather each move (M − 1)/M of
    the tensor through every learner. `dp_equivalent_bytes` in summaries is this per learner
    per step, summed over the learners' steps.
    """
    return 2 * (num_learners - 1) * num_params * bytes_per_param // max(num_learners, 1)
