"""The hand-framed data messages are exact protobuf: any protobuf reader parses them, and
``wire`` reads what protobuf writes; the host checksums are the standard ones."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

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


@pytest.mark.parametrize(("kind", "check"), [("crc32", 0xCBF43926), ("crc32c", 0xE3069283)])
def test_host_checksums_match_their_standard_check_values(kind, check):
    chunk = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert wire.checksum(kind, chunk) == check  # the catalogue's check value for "123456789"
    chunk[4] ^= 1
    assert wire.checksum(kind, chunk) != check


def test_out_of_band_host_transfers_use_crc32c_when_its_c_code_is_installed():
    # NOTE: deploy/setup.sh installs google-crc32c; a pure-Python fallback would be slower
    # than zlib, so the kind falls back to crc32 then
    assert wire.host_checksum_kind() == "crc32c"
