"""The data calls' bytes: reading a push's chunks to disk, cutting a pull's reply into chunks.

A push is a header chunk (seq 0, which may carry data) and data chunks numbered 1, 2, ...; the
last one carries the payload's CRC-32. `receive` writes the bytes to a push-store file as they
arrive, never more than the headers declared, and refuses any chunk out of order, a second
header, or bytes past the declared size (`wire.PayloadError`, whose message the service sends
back with INVALID_ARGUMENT). A pull's reply is cut from the published values as the reader
takes them (`full_reply`), or from the difference to the learner's own copy with a compressed
downlink (`delta_reply`).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import wire
from decoupled_diloco.core.compression import Codec


def receive(
    first: pb.PushChunk,
    rest: Iterator[bytes],
    expected: int,
    file: Any,
    touch: Callable[[], None],
    ended: Callable[[int], None],
) -> None:
    """Writes a push's payload to `file`, chunk by chunk, and checks it.

    Args:
      first: the parsed header chunk.
      rest: the raw chunks after it.
      expected: the payload bytes the headers declare.
      file: the push store's file (`write`).
      touch: called as each chunk arrives (the call is not idle).
      ended: called with the bytes read once the stream has ended, before the last checks.

    Raises:
      wire.PayloadError: a chunk out of order, unparsable, after the checksum chunk, or past
        `expected`; a payload short of `expected`, without a checksum, or not matching it.
    """
    at, crc, claimed = 0, 0, None
    for seq, raw in enumerate(itertools.chain([first], rest)):
        touch()
        if claimed is not None:
            raise wire.PayloadError(f"chunk {seq} after the checksum chunk")
        if seq == 0:
            data = first.data
            claimed = first.payload_crc32 if first.HasField("payload_crc32") else None
        else:
            data, claimed = _data_chunk(raw, seq)
        if at + len(data) > expected:
            raise wire.PayloadError(f"payload passed its declared {expected} bytes")
        file.write(data)
        at += len(data)
        crc = zlib.crc32(data, crc)
    ended(at)
    if at != expected:
        raise wire.PayloadError(f"payload ended at {at} of its {expected} bytes")
    if claimed is None:
        raise wire.PayloadError("the last chunk must carry payload_crc32")
    if crc != claimed:
        raise wire.PayloadError("payload checksum (payload_crc32) does not match")


def _data_chunk(raw: bytes, seq: int) -> tuple[memoryview, int | None]:
    """Push chunk number `seq`: its data, and the checksum if it is the last chunk."""
    parsed = wire.parse_push_data_chunk(raw)  # the common case, without a protobuf copy
    if parsed is not None:
        got, data = parsed
        claimed = None
    else:
        try:
            chunk = pb.PushChunk.FromString(raw if raw is not None else b"")
        except Exception:  # noqa: BLE001 - any decode failure is the peer's, not ours
            raise wire.PayloadError("malformed PushChunk") from None
        if chunk.HasField("header"):
            raise wire.PayloadError(f"chunk {seq} carries a second header")
        got, data = chunk.seq, memoryview(chunk.data)
        claimed = chunk.payload_crc32 if chunk.HasField("payload_crc32") else None
    if got != seq:
        raise wire.PayloadError(f"chunk {seq} arrived as seq {got} (reordered or lost)")
    return data, claimed


def full_reply(p: int, version: int, values: list, specs: list, chunk_bytes: int) -> Iterator[Any]:
    """Fragment p's values as a pull's reply: a header chunk, then raw data chunks.

    Cut from the published values as the reader takes them (a chunk at a time, nothing cached:
    a merged version is never changed in place, and a copy per fragment would cost the model's
    size again).
    """
    pieces = wire.chunk_arrays(values, chunk_bytes)
    yield pb.FragmentChunk(
        fragment=p,
        version=version,
        tensors=wire.headers(specs),
        total_bytes=sum(s.nbytes for s in specs),
        data=next(pieces),
    )
    for piece in pieces:
        yield wire.data_chunk(wire.PULL_DATA_TAG, piece)


def delta_reply(
    downlink: Any,
    request: pb.PullRequest,
    version: int,
    values: list,
    specs: list,
    chunk_bytes: int,
) -> Iterator[Any]:
    """A learner's pull with `compression.downlink`: the difference from its own copy."""
    base, payload = downlink.reply(
        request.learner_id,
        request.fragment,
        version,
        values,
        specs,
        request.have_version if request.has_copy else None,
    )
    codec = downlink.codec if base is not None else Codec("none")
    arrays = wire.encoded_arrays(payload, specs, codec) if base is not None else payload
    tensors = wire.headers(specs, codec)
    pieces = list(wire.chunk_arrays(arrays, chunk_bytes))
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
