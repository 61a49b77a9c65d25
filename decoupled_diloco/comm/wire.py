"""Wire format and transport settings shared by the syncer and its clients.

A fragment travels as a list of `TensorHeader`s (name, shape, dtype, encoding, format version,
byte count) plus the tensors' encoded bytes (`compression.layout`) concatenated in that order,
cut into chunks of `chunk_bytes` (~1 MiB: measured on loopback, smaller chunks cost throughput
and one big message is slower still). Decoding checks every header against what the receiver
expects before a byte is interpreted, and every decoded tensor before any is returned, so a
malformed payload is refused with a message and never half-applied.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence

import grpc
import numpy as np

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.config import SyncerConfig
from decoupled_diloco.core import compression
from decoupled_diloco.core.compression import Codec
from decoupled_diloco.core.fragments import TensorSpec

TOKEN_HEADER = "x-dd-run-token"
TOKEN_ENV = "DD_RUN_TOKEN"
# PushReply.reason of a push refused because its fragment already holds some of its data (a
# data lease handed to another learner meanwhile, `syncer.ledger`): its data was not lost.
REASON_COVERED = "covered"
# Control messages and chunks stay far below this; it bounds a single message (and so what a
# peer can make the syncer buffer before its first chunk is checked): 4 chunks if larger.
MAX_MESSAGE_BYTES = 8 << 20


# Protobuf tags (field number << 3 | length-delimited) of the `data` fields of PushChunk (2) and
# FragmentChunk (5). Chunks after the first carry only `data`; their encoding is then exactly
# tag + varint length + bytes, which both ends write and read without a protobuf copy.
PUSH_DATA_TAG = 2 << 3 | 2
PULL_DATA_TAG = 5 << 3 | 2
PUSH_SEQ_TAG = 3 << 3 | 0  # PushChunk.seq (varint), written before `data`


class PayloadError(ValueError):
    """A payload that does not match what the receiver expects; the message says why."""


def run_token(config: SyncerConfig) -> str:
    """The run token: `config.token`, else the `DD_RUN_TOKEN` environment variable.

    Surrounding whitespace is not part of it: a secret made with `openssl rand -hex 16 > FILE`
    ends with a newline, which a Kubernetes secret made from the file keeps.

    Raises:
      ValueError: neither is set (every RPC must carry a token).
    """
    token = config.token.strip() or os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"no run token: set config.decoupled.syncer.token or the {TOKEN_ENV} environment "
            "variable (the same value on the syncer and every learner)"
        )
    return token


# gRPC cuts a connection whose HTTP/2 ping (its flow-control probes) is not answered within
# `grpc.http2.ping_timeout_ms`, 60 s by default. On a saturated slow link the answer waits behind
# everything queued ahead of it (up to the flow-control window): a 2.2 MB push at 0.153 Mbit/s
# was cut after 91 s, and every retry the same way. Transfers have deadlines of their own
# (nothing moved for `rpc_timeout_s` on the client, `stream_idle_s` on the syncer), so the
# ping's only has to outlast the queue: this many times `rpc_timeout_s`.
PING_TIMEOUT_RPC_TIMEOUTS = 10


def channel_options(config: SyncerConfig) -> list[tuple[str, int]]:
    """Both ends' options: raised message limits, fast reconnect, patient pings."""
    limit = max(MAX_MESSAGE_BYTES, 4 * config.chunk_bytes)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # Reconnect within a second or so of a restarted syncer (gRPC's default backs off to
        # minutes), so that the client's own retries find it.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.http2.ping_timeout_ms", _ms(PING_TIMEOUT_RPC_TIMEOUTS * config.rpc_timeout_s)),
        # (a SETTINGS frame's acknowledgement waits behind the same queue)
        ("grpc.http2.settings_timeout", _ms(PING_TIMEOUT_RPC_TIMEOUTS * config.rpc_timeout_s)),
    ]


def _ms(seconds: float) -> int:
    return int(max(60.0, seconds) * 1000)  # (never below gRPC's own default)


_RAW = Codec("none")


def headers(specs: Sequence[TensorSpec], codec: Codec = _RAW) -> list[pb.TensorHeader]:
    """Protobuf headers of a fragment's tensors, all encoded with `codec` (default: raw)."""
    return [
        pb.TensorHeader(
            name=s.name,
            shape=list(s.shape),
            dtype=s.dtype,
            scheme=codec.scheme,
            block_size=codec.block_size,
            format_version=compression.FORMAT_VERSION,
            values_scheme=codec.values,
            topk_k=codec.k,
            payload_bytes=compression.nbytes(codec, math.prod(s.shape), s.dtype),
        )
        for s in specs
    ]


def codec_of(header: pb.TensorHeader) -> Codec:
    """The codec a header describes (unchecked; see `check_headers`)."""
    return Codec(header.scheme, header.block_size, header.values_scheme, header.topk_k)


def encoded_arrays(
    sections: Sequence[dict[str, np.ndarray]], specs: Sequence[TensorSpec], codec: Codec
) -> list[np.ndarray]:
    """The arrays to send for encoded tensors (`compression.encode` sections), in wire order."""
    return [
        np.asarray(a)
        for s, spec in zip(sections, specs, strict=True)
        for a in compression.flatten_sections(s, codec, math.prod(spec.shape))
    ]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def data_chunk(tag: int, data: bytes) -> bytes:
    """The protobuf encoding of a chunk message whose only field is `data` (one copy)."""
    return b"".join((bytes([tag]), _varint(len(data)), data))


def _read_varint(raw: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """(value, position after it) of the varint at `pos`, or None if it is cut short."""
    value, shift = 0, 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos
    return None


def parse_data_chunk(tag: int, raw: bytes) -> memoryview | None:
    """The `data` of a data-only chunk as a view on `raw`, or None if `raw` is anything else.

    Anything that is not exactly tag + length + bytes (e.g. a chunk with a header) returns None
    and goes through the regular protobuf parser.
    """
    if len(raw) < 2 or raw[0] != tag:
        return None
    read = _read_varint(raw, 1)
    if read is None or read[1] + read[0] != len(raw):
        return None
    return memoryview(raw)[read[1] :]


def push_data_chunk(seq: int, data: bytes) -> bytes:
    """A PushChunk with only `seq` and `data` (as protobuf encodes it, one copy)."""
    head = bytes([PUSH_SEQ_TAG]) + _varint(seq) + bytes([PUSH_DATA_TAG]) + _varint(len(data))
    return b"".join((head, data))


def parse_push_data_chunk(raw: bytes) -> tuple[int, memoryview] | None:
    """(seq, data view) of a chunk `push_data_chunk` wrote, or None for any other encoding."""
    if len(raw) < 3 or raw[0] != PUSH_SEQ_TAG:
        return None
    read = _read_varint(raw, 1)
    if read is None:
        return None
    view = parse_data_chunk(PUSH_DATA_TAG, memoryview(raw)[read[1] :])
    return None if view is None else (read[0], view)


def _le_bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))).cast(
        "B"
    )


def chunk_arrays(arrays: Sequence[np.ndarray], chunk_bytes: int) -> Iterator[bytes]:
    """The arrays' little-endian bytes cut into chunks, copied once (no concatenated buffer).

    An array may also be lazy, like `core.outer.Difference`: anything with `nbytes` and
    `le_bytes(start, stop)`, whose bytes are computed as each chunk is cut.
    """
    arrays = list(arrays)
    parts: list[memoryview | bytes] = []
    size = 0
    for a in arrays:
        lazy = hasattr(a, "le_bytes")
        view = None if lazy else _le_bytes(a)
        total, start = (a.nbytes if lazy else len(view)), 0
        while start < total:
            take = min(chunk_bytes - size, total - start)
            parts.append(a.le_bytes(start, start + take) if lazy else view[start : start + take])
            size += take
            start += take
            if size == chunk_bytes:
                yield bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
                parts, size = [], 0
    if parts or not any(a.nbytes for a in arrays):
        yield b"".join(parts)


def check_headers(got: Sequence[pb.TensorHeader], want: Sequence[TensorSpec]) -> int:
    """Checks a payload's headers against the expected specs; returns the expected byte count.

    Every field is checked: name, shape and dtype against the registered model; the format
    version; the encoding (a known scheme with consistent block size, value scheme and k);
    and each tensor's byte count against what its encoding of its shape takes.

    Raises:
      PayloadError: a missing, extra, renamed, reshaped or retyped tensor, an unknown format
        version or encoding, or an inconsistent byte count.
    """
    if len(got) != len(want):
        raise PayloadError(f"expected {len(want)} tensors, got {len(got)}")
    for header, spec in zip(got, want, strict=True):
        if header.name != spec.name:
            raise PayloadError(f"tensor {spec.index}: expected {spec.name!r}, got {header.name!r}")
        if tuple(header.shape) != spec.shape:
            raise PayloadError(
                f"{spec.name}: expected shape {spec.shape}, got {tuple(header.shape)}"
            )
        if header.dtype != spec.dtype:
            raise PayloadError(f"{spec.name}: expected dtype {spec.dtype}, got {header.dtype}")
        if header.format_version != compression.FORMAT_VERSION:
            raise PayloadError(
                f"{spec.name}: payload format version {header.format_version} is not supported "
                f"(this build reads version {compression.FORMAT_VERSION})"
            )
        codec = codec_of(header)
        try:
            codec.check()
        except compression.CodecError as error:
            raise PayloadError(f"{spec.name}: {error}") from None
        need = compression.nbytes(codec, math.prod(spec.shape), spec.dtype)
        if header.payload_bytes != need:
            raise PayloadError(
                f"{spec.name}: header says {header.payload_bytes} bytes, {codec.scheme} "
                f"encoding of shape {spec.shape} takes {need}"
            )
    return sum(h.payload_bytes for h in got)


def decode_payload(
    payload: bytes | memoryview,
    tensors: Sequence[pb.TensorHeader],
    specs: Sequence[TensorSpec],
    require_finite: bool = True,
) -> list[np.ndarray]:
    """Decodes a payload whose headers passed `check_headers` into arrays of the specs' dtypes.

    Raw tensors (scheme "none") are read-only views on `payload`; the rest are decoded
    (`compression.decode`, which also checks their content). Nothing is returned unless every
    tensor decodes, so a bad payload is never half-applied.

    Raises:
      PayloadError: wrong total or per-tensor size, content no encoder would produce, or
        (with `require_finite`) a NaN or infinity.
    """
    expected = sum(h.payload_bytes for h in tensors)
    if len(payload) != expected:
        raise PayloadError(f"payload has {len(payload)} bytes, headers describe {expected}")
    arrays, offset = [], 0
    for header, spec in zip(tensors, specs, strict=True):
        piece = memoryview(payload)[offset : offset + header.payload_bytes]
        arrays.append(decode_tensor(piece, codec_of(header), spec, require_finite))
        offset += header.payload_bytes
    return arrays


def decode_tensor(
    data: bytes | memoryview, codec: Codec, spec: TensorSpec, require_finite: bool = True
) -> np.ndarray:
    """Decodes one tensor's bytes (its `compression.layout` sections) into an array of `spec`.

    Raises:
      PayloadError: content no encoder would produce, or (with `require_finite`) a NaN or
        infinity.
    """
    n, sections, at = math.prod(spec.shape), {}, 0
    for name, dtype, count in compression.layout(codec, n, spec.dtype):
        dtype = dtype.newbyteorder("<")
        sections[name] = np.frombuffer(data, dtype=dtype, count=count, offset=at)
        at += count * dtype.itemsize
    if codec.scheme == "none":
        flat = sections["values"]
        # One cheap pass (a sum is NaN/inf if any element is); the exact check only on alarm,
        # so a huge-but-finite tensor whose sum overflows is still accepted.
        if require_finite:
            with np.errstate(over="ignore", invalid="ignore"):
                alarm = not np.isfinite(flat.sum())
            if alarm and not np.isfinite(flat).all():
                raise PayloadError(f"{spec.name}: non-finite values (NaN or infinity)")
    else:
        try:
            flat = compression.decode(sections, n, codec)
        except compression.CodecError as error:
            raise PayloadError(f"{spec.name}: {codec.scheme} payload: {error}") from None
    return flat.reshape(spec.shape).astype(np.dtype(spec.dtype), copy=False)


def server_credentials(config: SyncerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files, or None for a plaintext server."""
    if not config.tls_cert:
        return None
    with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
        return grpc.ssl_server_credentials([(key.read(), cert.read())])


def make_channel(address: str, config: SyncerConfig, own_connection: bool = False) -> grpc.Channel:
    """A channel to the syncer: TLS trusting `tls_cert` when set, raised message limits.

    With `own_connection`, its TCP connection is its own (gRPC otherwise shares one among the
    channels of a process to the same address).
    """
    options = channel_options(config)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if config.tls_cert:
        with open(config.tls_cert, "rb") as cert:
            credentials = grpc.ssl_channel_credentials(root_certificates=cert.read())
        return grpc.secure_channel(address, credentials, options=options)
    return grpc.insecure_channel(address, options=options)
