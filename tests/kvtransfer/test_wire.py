"""The hand-framed data messages are exact protobuf: any protobuf reader parses them, and
``wire`` reads what protobuf writes."""

from __future__ import annotations

import os
import zlib

import pytest

from kvtransfer import wire
from proto.pdserve.v1 import kv_transfer_pb2 as pb


@pytest.mark.parametrize("seq", [0, 1, 300, 2**32 - 1])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 70_000])
def test_chunk_frames_are_protobuf_both_ways(seq, size):
    data = os.urandom(size)
    raw = wire.data_frame(2, ((1, seq),), 2, memoryview(data), 3)
    msg = pb.PullKVResponse.FromString(raw)
    assert msg.WhichOneof("msg") == "chunk"
    assert (msg.chunk.seq, msg.chunk.data, msg.chunk.crc32) == (seq, data, zlib.crc32(data))
    fields, view = wire.read_data_frame(msg.SerializeToString(), 2)
    assert bytes(view) == data and fields.get(1, 0) == seq and fields.get(3, 0) == zlib.crc32(data)


def test_piece_frames_are_protobuf_both_ways():
    data = os.urandom(4096)
    raw = wire.data_frame(2, ((1, 5), (2, 29), (3, 0), (4, 2048)), 5, memoryview(data), 6)
    p = pb.StreamKVResponse.FromString(raw).piece
    assert (p.seq, p.layer, p.token_start, p.token_end, p.data) == (5, 29, 0, 2048, data)
    fields, view = wire.read_data_frame(raw, 2)
    assert fields == {1: 5, 2: 29, 4: 2048, 6: zlib.crc32(data)} and bytes(view) == data


def test_other_messages_and_damage():
    header = pb.PullKVResponse(header=pb.KVHeader(request_id="r")).SerializeToString()
    assert wire.read_data_frame(header, 2) is None  # a header: protobuf parses it
    raw = wire.data_frame(2, ((1, 1),), 2, memoryview(b"abc" * 100), 3)
    for bad in (raw[:-3], raw + b"\x00", raw[:1] + b"\xff" * 12):
        with pytest.raises(wire.TransferError, match="malformed"):
            wire.read_data_frame(bad, 2)
