"""Wire format: chunking, data-only chunk encoding, payload checks."""

import numpy as np
import pytest

from decoupled_diloco.comm import syncer_pb2 as pb
from decoupled_diloco.comm import wire
from decoupled_diloco.core import fragments as F
from tests.helpers import from_bytes, to_bytes


def _arrays():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in [(3, 5), (7,), (40, 33), (1,)]]


@pytest.mark.parametrize("chunk", [1024, 4096, 1 << 20])
def test_chunk_arrays_round_trips_across_tensor_boundaries(chunk):
    arrays = _arrays()
    specs = F.tensor_specs(arrays)
    pieces = list(wire.chunk_arrays(arrays, chunk))
    assert all(len(p) == chunk for p in pieces[:-1]) and 0 < len(pieces[-1]) <= chunk
    assert b"".join(pieces) == to_bytes(arrays)
    for got, want in zip(from_bytes(b"".join(pieces), specs), arrays, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk", [1026, 4096, 1 << 20])  # (1026: cuts inside a float)
def test_a_difference_streams_the_bytes_of_the_whole_difference(chunk):
    from decoupled_diloco.core import outer

    anchors = _arrays()
    local = [np.sin(x) * 3 for x in anchors]
    lazy = [outer.Difference(a, x) for a, x in zip(anchors, local, strict=True)]
    whole = [a - x for a, x in zip(anchors, local, strict=True)]
    assert [d.nbytes for d in lazy] == [w.nbytes for w in whole]
    assert list(wire.chunk_arrays(lazy, chunk)) == list(wire.chunk_arrays(whole, chunk))
    np.testing.assert_array_equal(np.asarray(lazy[2]), whole[2])
    with pytest.raises(ValueError, match="differ"):
        outer.Difference(anchors[0], local[1])


def test_data_only_chunks_match_protobuf_and_anything_else_is_not_taken():
    data = bytes(range(256)) * 700  # a multi-byte varint length
    for tag, message in (
        (wire.PUSH_DATA_TAG, pb.PushChunk),
        (wire.PULL_DATA_TAG, pb.FragmentChunk),
    ):
        encoded = wire.data_chunk(tag, data)
        assert encoded == message(data=data).SerializeToString()
        assert bytes(wire.parse_data_chunk(tag, encoded)) == data
        assert wire.parse_data_chunk(tag, encoded[:-1]) is None  # truncated
    with_header = pb.PushChunk(header=pb.PushHeader(learner_id=1), data=data).SerializeToString()
    assert wire.parse_data_chunk(wire.PUSH_DATA_TAG, with_header) is None
    both = pb.FragmentChunk(version=3, data=data).SerializeToString()
    assert wire.parse_data_chunk(wire.PULL_DATA_TAG, both) is None


def test_payload_checks_name_what_is_wrong():
    arrays = _arrays()
    specs = F.tensor_specs(arrays)
    payload = to_bytes(arrays)
    with pytest.raises(wire.PayloadError, match="bytes"):
        from_bytes(payload[:-4], specs)
    bad = [a.copy() for a in arrays]
    bad[2][5, 5] = np.inf
    with pytest.raises(wire.PayloadError, match="non-finite"):
        from_bytes(to_bytes(bad), specs)
    huge = [np.full_like(a, 3e38) for a in arrays]  # finite, but its sum overflows
    assert len(from_bytes(to_bytes(huge), specs)) == len(arrays)
    headers = wire.headers(specs)
    assert wire.check_headers(headers, specs) == len(payload)
    headers[1].dtype = "int32"
    with pytest.raises(wire.PayloadError, match="dtype"):
        wire.check_headers(headers, specs)
