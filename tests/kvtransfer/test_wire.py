"""The hand-framed data messages are exact protobuf: any protobuf reader parses them, and
``wire`` reads what protobuf writes; the host checksums are the standard ones."""

from __future__ import annotations

import dataclasses
import os
import zlib

import google_crc32c
import pytest
import torch

from kvtransfer import wire
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.kv_stream import KVPiece
from tests.kvtransfer.kv_fixtures import random_handle

CRC = {"crc32": zlib.crc32, "crc32c": lambda b: google_crc32c.value(bytes(b))}


@pytest.mark.parametrize("kind", ["crc32", "crc32c"])
@pytest.mark.parametrize("seq", [0, 1, 300, 2**32 - 1])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 70_000])
def test_chunk_frames_are_protobuf_both_ways(seq, size, kind):
    data = os.urandom(size)
    raw = wire.data_frame(2, ((1, seq),), 2, memoryview(data), wire.CHUNK_CRC, kind)
    msg = pb.PullKVResponse.FromString(raw)
    assert msg.WhichOneof("msg") == "chunk"
    assert (msg.chunk.seq, msg.chunk.data) == (seq, data)
    # exactly the field of its kind is set (an empty chunk's CRC is 0: presence still shows)
    assert msg.chunk.WhichOneof("_crc32c" if kind == "crc32c" else "_crc32") is not None
    assert msg.chunk.WhichOneof("_crc32" if kind == "crc32c" else "_crc32c") is None
    assert getattr(msg.chunk, kind) == CRC[kind](data)
    fields, view = wire.read_data_frame(msg.SerializeToString(), 2)
    assert bytes(view) == data and fields.get(1, 0) == seq
    wire.check_frame(fields, view, wire.CHUNK_CRC, "chunk")  # passes


def test_senders_use_crc32c_and_receivers_check_either_kind():
    data = os.urandom(5000)
    fields, view = wire.read_data_frame(wire.data_frame(2, (), 2, memoryview(data), (3, 4)), 2)
    assert fields == {4: CRC["crc32c"](data)}  # the default kind where its C code is installed
    for kind in ("crc32", "crc32c"):  # e.g. a sender without google-crc32c's C code
        raw = pb.PullKVResponse(chunk=pb.KVChunk(seq=0, data=data, **{kind: CRC[kind](data)}))
        fields, view = wire.read_data_frame(raw.SerializeToString(), 2)
        wire.check_frame(fields, view, wire.CHUNK_CRC, "chunk 0")
        fields[3 if kind == "crc32" else 4] ^= 1
        with pytest.raises(wire.TransferError, match=f"chunk 0 failed its {kind} check"):
            wire.check_frame(fields, view, wire.CHUNK_CRC, "chunk 0")
    raw = pb.PullKVResponse(chunk=pb.KVChunk(seq=0, data=data)).SerializeToString()
    fields, view = wire.read_data_frame(raw, 2)
    with pytest.raises(wire.TransferError, match="chunk 0 carries no checksum"):
        wire.check_frame(fields, view, wire.CHUNK_CRC, "chunk 0")


def test_piece_frames_are_protobuf_both_ways():
    data = os.urandom(4096)
    frame = wire.data_frame(2, ((1, 5), (2, 29), (3, 0), (4, 2048)), 5, memoryview(data), (6, 7))
    p = pb.StreamKVResponse.FromString(frame).piece
    assert (p.seq, p.layer, p.token_start, p.token_end, p.data) == (5, 29, 0, 2048, data)
    assert p.crc32c == CRC["crc32c"](data) and not p.HasField("crc32")
    fields, view = wire.read_data_frame(frame, 2)
    assert fields == {1: 5, 2: 29, 4: 2048, 7: CRC["crc32c"](data)} and bytes(view) == data


def test_other_messages_and_damage():
    header = pb.PullKVResponse(header=pb.KVHeader(request_id="r")).SerializeToString()
    assert wire.read_data_frame(header, 2) is None  # a header: protobuf parses it
    raw = wire.data_frame(2, ((1, 1),), 2, memoryview(b"abc" * 100), wire.CHUNK_CRC)
    for bad in (raw[:-3], raw + b"\x00", raw[:1] + b"\xff" * 12):
        with pytest.raises(wire.TransferError, match="malformed"):
            wire.read_data_frame(bad, 2)


@pytest.mark.parametrize(("kind", "check"), [("crc32", 0xCBF43926), ("crc32c", 0xE3069283)])
def test_host_checksums_match_their_standard_check_values(kind, check):
    chunk = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert wire.checksum(kind, chunk) == check  # the catalogue's check value for "123456789"
    chunk[4] ^= 1
    assert wire.checksum(kind, chunk) != check


def test_host_transfers_use_crc32c_when_its_c_code_is_installed():
    # NOTE: deploy/setup.sh installs google-crc32c; a pure-Python fallback would be slower
    # than zlib, so the kind falls back to crc32 then
    assert wire.host_checksum_kind() == "crc32c"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kv_on_a_gpu_is_encoded_through_host_memory():
    h = random_handle()
    on_gpu = dataclasses.replace(h, blocks=h.blocks.cuda())
    got = wire.decode(iter(list(wire.encode(on_gpu))), h.fingerprint)
    assert torch.equal(got.blocks.view(torch.uint8), h.blocks.view(torch.uint8))


def test_a_stream_announces_its_last_layer_once_before_the_trailer():
    """``on_layers`` (the decode engine's cue that the request joins soon) fires when every
    position of the last layer is in: not at the first chunk's last layer, not at the
    trailer."""
    h = random_handle(layers=3, n_blocks=5)
    fp, n = h.fingerprint, h.num_computed
    kv = h.blocks.reshape(fp.num_layers, 2, -1, fp.num_kv_heads, fp.head_dim)
    frames = [wire.stream_header("r", fp, n)]
    seq = 0
    for a, b in ((0, 8), (8, n)):  # two prompt chunks, each through every layer
        for layer in range(fp.num_layers):
            piece = KVPiece(layer, a, b, kv[layer, :, a:b].contiguous())
            parts = wire.piece_frames(piece, seq, 0)
            frames += parts
            seq += len(parts)
    frames.append(wire.stream_trailer(h, seq, 1000.0))
    read: list[int] = []
    calls: list[int] = []

    def messages():
        for i, f in enumerate(frames):
            read.append(i)
            yield f

    got, _ = wire.decode_stream(messages(), fp, lambda: calls.append(read[-1]))
    assert calls == [len(frames) - 2]  # right after the last piece, once
    shape = (fp.num_layers, 2, -1, fp.num_kv_heads, fp.head_dim)
    assert torch.equal(got.blocks.reshape(shape)[:, :, :n], kv[:, :, :n])
