"""KV handle <-> wire messages (proto ``pdserve.v1.KVTransfer``): header, then CRC-checked chunks.

Invariant: a receiver either returns a handle whose every byte passed its chunk's checksum and
whose layout equals the receiver's own, or raises; it never returns partial or unchecked KV.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtransfer.base import TransferError, check_layout
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.kv_cache import empty_bytes
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.kv_quant import row_layout
from services.engine.kv_stream import KVPiece

if TYPE_CHECKING:
    from kvtransfer.shm import SegmentReader

try:
    import google_crc32c
except ImportError:  # NOTE: installed by deploy/setup.sh; without it host transfers use crc32
    google_crc32c = None

# NOTE: 2 MiB: against 512 KiB the sender spends about a tenth less CPU per GB (fewer
# messages, each a Python-level hand-off), and grpc, gloo and gRPC's own floor all moved
# 15-20% faster at 64-256 MB in interleaved runs (BENCHMARKS.md); still far under every
# message limit, and one layer's piece of a 512-token prefill chunk (786 KB) stays whole
DEFAULT_CHUNK_BYTES = 2 << 20


def storage(fp: LayoutFingerprint) -> tuple[int, torch.dtype]:
    """(elements of one stored (position, kv head) row, their dtype) of a layout's blocks."""
    try:
        return row_layout(fp.dtype, fp.head_dim)
    except ValueError as e:
        raise TransferError(str(e)) from None


def layout_to_proto(fp: LayoutFingerprint) -> pb.KVLayout:
    return pb.KVLayout(
        model_id=fp.model_id,
        num_layers=fp.num_layers,
        num_kv_heads=fp.num_kv_heads,
        head_dim=fp.head_dim,
        block_size=fp.block_size,
        dtype=fp.dtype,
    )


def layout_from_proto(m: pb.KVLayout) -> LayoutFingerprint:
    return LayoutFingerprint(
        m.model_id, m.num_layers, m.num_kv_heads, m.head_dim, m.block_size, m.dtype
    )


def _header(
    handle: KVHandle, total: int, n_chunks: int, num_blocks: int | None = None
) -> pb.KVHeader:
    header = pb.KVHeader(
        request_id=handle.request_id,
        token_ids=handle.token_ids,
        num_computed=handle.num_computed,
        layout=layout_to_proto(handle.fingerprint),
        block_hashes=handle.block_hashes,
        num_blocks=handle.num_blocks if num_blocks is None else num_blocks,
        total_bytes=total,
        num_chunks=n_chunks,
    )
    if handle.first_logprob is not None:
        header.first_logprob = handle.first_logprob
    return header


# ---- hand-framed data messages ---------------------------------------------------------------
# NOTE: the messages that carry KV bytes (KVChunk, KVLayerPiece) are framed here instead of by
# protobuf: protobuf would copy the bytes into a message and again into its serialization, and
# parse them into a third copy. These frames are the exact protobuf encoding (any protobuf
# reader parses them; ``tests/kvtransfer`` checks both ways), built with one copy of the data
# and read as a view into the received bytes.


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# The (crc32, crc32c) field numbers of each data message: a frame sets exactly one of them.
CHUNK_CRC = (3, 4)  # KVChunk
PIECE_CRC = (6, 7)  # KVLayerPiece


def data_frame(
    outer: int,
    fields: Iterable[tuple[int, int]],
    data_field: int,
    data: memoryview,
    crc_fields: tuple[int, int],
    kind: str | None = None,
) -> bytes:
    """The encoding of ``{outer: {fields..., data_field: data, <checksum field>: its
    checksum}}``: CRC-32C (the second of ``crc_fields``) where its C code is installed, else
    CRC-32 (``kind`` forces one)."""
    kind = kind or _HOST_CHECKSUM
    crc_field = crc_fields[kind == "crc32c"]
    head = b"".join(_varint(f << 3) + _varint(v) for f, v in fields if v)
    data_tag = _varint(data_field << 3 | 2) + _varint(len(data))
    tail = _varint(crc_field << 3 | 5) + struct.pack("<I", crc(kind, data))
    inner = len(head) + len(data_tag) + len(data) + len(tail)
    return b"".join((_varint(outer << 3 | 2), _varint(inner), head, data_tag, data, tail))


def check_frame(
    fields: dict[int, int], data: memoryview, crc_fields: tuple[int, int], what: str
) -> None:
    """Raises TransferError unless the frame's checksum, of whichever kind it carries,
    matches ``data``."""
    c32, c32c = crc_fields
    if c32c in fields:
        kind, want = "crc32c", fields[c32c]
    elif c32 in fields:
        kind, want = "crc32", fields[c32]
    else:
        raise TransferError(f"{what} carries no checksum")
    if crc(kind, data) != want:
        raise TransferError(f"{what} failed its {kind} check")


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise TransferError("malformed message: bad varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def read_data_frame(raw: bytes, outer: int) -> tuple[dict[int, int], memoryview] | None:
    """Inverse of ``data_frame``: (scalar fields by number, a view of the data), or None when
    ``raw`` is not an ``outer`` message (a header: parse it with protobuf). Unknown fields are
    skipped; the checksum field comes back among the scalars."""
    buf = memoryview(raw)
    tag, i = _read_varint(buf, 0)
    if tag != (outer << 3 | 2):
        return None
    n, i = _read_varint(buf, i)
    end = i + n
    if end != len(buf):
        raise TransferError("malformed message: length does not match")
    fields: dict[int, int] = {}
    data = memoryview(b"")
    while i < end:
        tag, i = _read_varint(buf, i)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            fields[field], i = _read_varint(buf, i)
        elif kind == 2:
            n, i = _read_varint(buf, i)
            data = buf[i : i + n]
            i += n
        elif kind == 5:
            (fields[field],) = struct.unpack_from("<I", buf, i)
            i += 4
        elif kind == 1:
            (fields[field],) = struct.unpack_from("<Q", buf, i)
            i += 8
        else:
            raise TransferError(f"malformed message: wire type {kind}")
    if i != end:
        raise TransferError("malformed message: truncated field")
    return fields, data


def serialize(msg: object) -> bytes:
    """gRPC response serializer: hand-framed bytes pass through, messages serialize."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()  # type: ignore[attr-defined]


def encode(handle: KVHandle, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Serialized ``PullKVResponse``s: the header, then the block tensor's bytes in chunks of
    at most ``chunk_bytes``."""
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    # NOTE: KV on a GPU is copied to host memory first (numpy reads host memory only); a
    # no-op for CPU KV
    payload = memoryview(payload_of(handle).cpu().numpy()).cast("B")
    total = len(payload)
    n_chunks = max(1, -(-total // chunk_bytes))
    yield pb.PullKVResponse(header=_header(handle, total, n_chunks)).SerializeToString()
    for seq in range(n_chunks):
        # PullKVResponse.chunk = 2 {seq = 1, data = 2, crc32 = 3 | crc32c = 4}
        data = payload[seq * chunk_bytes : (seq + 1) * chunk_bytes]
        yield data_frame(2, ((1, seq),), 2, data, CHUNK_CRC)


def payload_of(handle: KVHandle) -> torch.Tensor:
    """The block tensor as contiguous 1-D bytes (on the handle's device)."""
    return handle.blocks.contiguous().view(torch.uint8).reshape(-1)


def chunk_ranges(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    return [(a, min(total, a + chunk_bytes)) for a in range(0, max(total, 1), chunk_bytes)]


def host_checksum_kind() -> str:
    """The checksum of host bytes on every transport (gRPC messages, shared-memory segments,
    gloo chunks): CRC-32C where its C implementation is installed (about 3x zlib's CRC-32
    here: it was 60% of a shared-memory pull and a third of a gRPC receiver's CPU), else
    CRC-32. Receivers check either kind, whatever they would send."""
    return _HOST_CHECKSUM


# NOTE: decided once: a pure-Python CRC-32C fallback would be far slower than zlib's CRC-32
_HOST_CHECKSUM = (
    "crc32c" if google_crc32c is not None and google_crc32c.implementation == "c" else "crc32"
)


def crc(kind: str, data: memoryview | np.ndarray) -> int:
    """``crc32`` (zlib) or ``crc32c`` of host bytes, read in place."""
    if kind == "crc32":
        return zlib.crc32(data)
    if kind == "crc32c":
        if google_crc32c is None:
            raise TransferError("checksum crc32c needs the google-crc32c package")
        # NOTE: its C code takes numpy arrays and bytes, not memoryviews; frombuffer is a view
        return google_crc32c.value(np.frombuffer(data, dtype=np.uint8))
    raise TransferError(f"unknown checksum {kind!r}")


def checksum(kind: str, chunk: torch.Tensor) -> int:
    """``crc32`` / ``crc32c`` of a CPU chunk, or ``sum64`` (the int32 words' 64-bit sum plus
    the length, computed where the chunk lives: no copy off a GPU)."""
    if kind == "sum64":
        words = chunk[: chunk.numel() // 4 * 4].view(torch.int32)
        tail = chunk[chunk.numel() // 4 * 4 :].to(torch.int64).sum()
        total = words.sum(dtype=torch.int64) + tail + chunk.numel()
        return int(total.item()) & 0xFFFF_FFFF_FFFF_FFFF
    return crc(kind, chunk.numpy())


def header_for(
    handle: KVHandle, data: torch.Tensor, chunk_bytes: int, kind: str | None = None
) -> pb.KVHeader:
    """The header of an out-of-band transfer: sizes and each chunk's checksum."""
    kind = kind or (host_checksum_kind() if data.device.type == "cpu" else "sum64")
    ranges = chunk_ranges(data.numel(), chunk_bytes)
    header = _header(handle, data.numel(), len(ranges))
    header.chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
    header.checksum = kind
    header.chunk_checksums.extend(checksum(kind, data[a:b]) for a, b in ranges)
    return header


def check_header(
    h: pb.KVHeader, expected: LayoutFingerprint
) -> tuple[tuple[int, ...], torch.dtype]:
    """The block tensor's shape and dtype the header describes; raises if it is not the
    receiver's layout or its sizes do not add up."""
    layout = layout_from_proto(h.layout)
    check_layout(layout, expected)
    row, dtype = storage(layout)
    shape = (
        layout.num_layers,
        2,
        h.num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        row,
    )
    want_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if h.total_bytes != want_bytes:
        raise TransferError(f"header says {h.total_bytes} bytes, layout needs {want_bytes}")
    return shape, dtype


def verify_chunk(h: pb.KVHeader, seq: int, chunk: torch.Tensor) -> None:
    if checksum(h.checksum, chunk) != h.chunk_checksums[seq]:
        raise TransferError(f"chunk {seq} failed its {h.checksum} check")


def handle_from(h: pb.KVHeader, data: torch.Tensor, expected: LayoutFingerprint) -> KVHandle:
    """A handle over received bytes ``data`` (1-D uint8) that were checked chunk by chunk."""
    shape, dtype = check_header(h, expected)
    if data.numel() != h.total_bytes:
        raise TransferError(f"received {data.numel()} of {h.total_bytes} bytes")
    return KVHandle(
        request_id=h.request_id,
        token_ids=tuple(h.token_ids),
        num_computed=h.num_computed,
        fingerprint=layout_from_proto(h.layout),
        block_hashes=tuple(h.block_hashes),
        blocks=data.view(dtype).reshape(shape),
        first_logprob=h.first_logprob if h.HasField("first_logprob") else None,
    )


# ---- same-host handover (transport ``shm``) ----------------------------------------------------
# The header names the sender's segment; then one KVChunk per chunk, sent once the chunk is in
# the segment, carries its seq and checksum and no data: the receiver copies chunk i out while
# the sender writes chunk i+1.


def segment_header(handle: KVHandle, total: int, chunk_bytes: int, name: str) -> bytes:
    n_chunks = len(chunk_ranges(total, chunk_bytes))
    h = _header(handle, total, n_chunks)
    h.chunk_bytes, h.shm_name = chunk_bytes, name
    return pb.PullKVResponse(header=h).SerializeToString()


def segment_notice(seq: int, chunk: torch.Tensor, kind: str | None = None) -> bytes:
    """The KVChunk announcing chunk ``seq`` (1-D uint8, CPU) as written: its checksum only."""
    kind = kind or _HOST_CHECKSUM
    msg = pb.KVChunk(seq=seq, **{kind: checksum(kind, chunk)})
    return pb.PullKVResponse(chunk=msg).SerializeToString()


def _from_segment(
    h: pb.KVHeader, it: Iterator[bytes], expected: LayoutFingerprint, segments: SegmentReader
) -> KVHandle:
    """Copy each announced chunk out of the sender's segment and check it *on the copy* (the
    sender reuses the segment once released: a copy taken too late fails its checksum)."""
    try:
        src = segments.view(h.shm_name, h.total_bytes)
    except (OSError, ValueError) as e:
        raise TransferError(f"shared-memory segment {h.shm_name!r}: {e}") from None
    ranges = chunk_ranges(h.total_bytes, h.chunk_bytes)
    if len(ranges) != h.num_chunks:
        raise TransferError(f"header says {h.num_chunks} chunks, its sizes make {len(ranges)}")
    buf = empty_bytes(h.total_bytes)
    out = buf.numpy()
    for seq, (a, b) in enumerate(ranges):
        raw = next(it, None)
        frame = read_data_frame(raw, 2) if raw is not None else None
        if frame is None:
            raise TransferError(f"transfer ended after {seq} of {h.num_chunks} chunks")
        fields, data = frame
        if fields.get(1, 0) != seq or len(data):
            raise TransferError(f"chunk notice {fields.get(1, 0)} arrived where {seq} was due")
        buf[a:b].copy_(src[a:b])
        check_frame(fields, memoryview(out[a:b]), CHUNK_CRC, f"chunk {seq}")
    return handle_from(h, buf, expected)


def decode(
    messages: Iterable[bytes], expected: LayoutFingerprint, segments: SegmentReader | None = None
) -> KVHandle:
    """Rebuild a handle from serialized ``PullKVResponse``s (or, from a same-host sender, a
    header naming a shared-memory segment: ``segments`` reads it); raises
    LayoutMismatchError or TransferError."""
    it = iter(messages)
    raw = next(it, None)
    first = pb.PullKVResponse.FromString(raw) if raw is not None else None
    if first is None or first.WhichOneof("msg") != "header":
        raise TransferError("transfer did not start with a header")
    h = first.header
    check_header(h, expected)
    if h.shm_name:  # same-host handover: the payload is in shared memory, not in chunks
        if segments is None:
            raise TransferError("the sender named a shared-memory segment nobody asked for")
        return _from_segment(h, it, expected, segments)
    want_bytes = h.total_bytes
    # NOTE: uninitialised, not a bytearray: no zeroing pass over memory every chunk overwrites
    buf = empty_bytes(want_bytes)
    out = buf.numpy()  # the same memory; numpy reads the read-only message bytes without a copy
    offset = 0
    for seq in range(h.num_chunks):
        raw = next(it, None)
        frame = read_data_frame(raw, 2) if raw is not None else None
        if frame is None:
            raise TransferError(f"transfer ended after {seq} of {h.num_chunks} chunks")
        fields, data = frame
        if fields.get(1, 0) != seq:
            raise TransferError(f"chunk {fields.get(1, 0)} arrived where {seq} was due")
        check_frame(fields, data, CHUNK_CRC, f"chunk {seq}")
        end = offset + len(data)
        if end > want_bytes:
            raise TransferError("chunks carry more bytes than the header announced")
        out[offset:end] = np.frombuffer(data, dtype=np.uint8)
        offset = end
    if offset != want_bytes:
        raise TransferError(f"received {offset} of {want_bytes} bytes")
    return handle_from(h, buf, expected)


# ---- layer-wise streams (StreamKV) -----------------------------------------------------------
def stream_header(request_id: str, fp: LayoutFingerprint, num_tokens: int) -> bytes:
    """The first ``StreamKVResponse``: what the receiver allocates for."""
    n_blocks = -(-num_tokens // fp.block_size)
    h = pb.KVHeader(
        request_id=request_id,
        num_computed=num_tokens,
        layout=layout_to_proto(fp),
        num_blocks=n_blocks,
    )
    return pb.StreamKVResponse(header=h).SerializeToString()


STREAM_HEARTBEAT = pb.StreamKVResponse(heartbeat=pb.StreamKVHeartbeat()).SerializeToString()


def piece_parts(piece: KVPiece, max_bytes: int) -> list[tuple[int, int, torch.Tensor]]:
    """One layer piece split by position so that no part carries more than ``max_bytes`` (a
    long prompt's layer can exceed a message limit): (token_start, token_end, the part's
    ``[2, n, heads, dim]`` KV as contiguous 1-D bytes, on the piece's device)."""
    data = piece.data.contiguous()
    n = piece.token_end - piece.token_start
    per_token = data.numel() * data.element_size() // max(1, n)
    step = max(1, (max_bytes or DEFAULT_CHUNK_BYTES) // max(1, per_token))
    return [
        (
            piece.token_start + a,
            piece.token_start + min(n, a + step),
            data[:, a : a + step].contiguous().view(torch.uint8).reshape(-1),
        )
        for a in range(0, n, step)
    ]


def piece_frames(piece: KVPiece, first_seq: int, max_bytes: int) -> list[bytes]:
    """``StreamKVResponse.piece`` frames of one layer piece (``piece_parts``)."""
    if piece.data.device.type != "cpu":
        piece = dataclasses.replace(piece, data=piece.data.cpu())
    return [
        # StreamKVResponse.piece = 2 {seq, layer, token_start, token_end, data = 5,
        # crc32 = 6 | crc32c = 7}
        data_frame(
            2,
            ((1, seq), (2, piece.layer), (3, a), (4, b)),
            5,
            memoryview(part.numpy()).cast("B"),
            PIECE_CRC,
        )
        for seq, (a, b, part) in enumerate(piece_parts(piece, max_bytes), first_seq)
    ]


def stream_trailer(handle: KVHandle, num_pieces: int, finished_unix: float) -> bytes:
    h = _header(handle, 0, num_pieces, -(-handle.num_computed // handle.fingerprint.block_size))
    h.finished_unix = finished_unix
    return pb.StreamKVResponse(trailer=h).SerializeToString()


class StreamAssembler:
    """The receiver's side of a layer-wise stream, whatever carries it: allocates for the
    stream header, places each checked piece, and builds the handle at the trailer once
    every position of every layer has arrived (pieces in sequence; else TransferError,
    LayoutMismatchError on a layout). ``on_layers``: called once, when every position of
    the last layer is in (only the trailer is still to come)."""

    def __init__(
        self,
        h: pb.KVHeader,
        expected: LayoutFingerprint,
        device: torch.device | str = "cpu",
        on_layers: Callable[[], None] | None = None,
    ) -> None:
        self.on_layers = on_layers
        check_layout(layout_from_proto(h.layout), expected)
        fp = self.fp = expected
        row, dtype = storage(fp)
        self.n_tokens, self.n_blocks = h.num_computed, h.num_blocks
        if self.n_blocks != -(-self.n_tokens // fp.block_size):
            raise TransferError(f"header says {self.n_blocks} blocks for {self.n_tokens} tokens")
        esize = torch.empty((), dtype=dtype).element_size()
        self.row = fp.num_kv_heads * row * esize  # bytes of one position of k (or v)
        slots = self.n_blocks * fp.block_size
        # NOTE: uninitialised: no zeroing pass over memory the pieces overwrite
        self.buf = empty_bytes(fp.num_layers * 2 * slots * self.row, device)
        self.out = self.buf.view(fp.num_layers, 2, slots, self.row)
        self.out[:, :, self.n_tokens :] = 0  # the last block's unused tail: never read as context
        self._np = self.out.numpy() if self.buf.device.type == "cpu" else None
        self.covered = np.zeros((fp.num_layers, self.n_tokens), dtype=bool)
        self.seq = 0

    def check(self, seq: int, layer: int, a: int, b: int, nbytes: int) -> None:
        """Raises unless piece ``seq`` is the next one and fits the KV (before it is read)."""
        if seq != self.seq:
            raise TransferError(f"piece {seq} arrived where {self.seq} was due")
        if (
            layer >= self.fp.num_layers
            or not a < b <= self.n_tokens
            or nbytes != 2 * (b - a) * self.row
        ):
            raise TransferError(f"piece {seq} (layer {layer}, positions {a}:{b}) does not fit")

    def place(self, layer: int, a: int, b: int, data: memoryview | torch.Tensor) -> None:
        """Store a checked piece (``check`` passed, its checksum too)."""
        if isinstance(data, torch.Tensor):
            self.out[layer, :, a:b] = data.view(2, b - a, self.row)
        else:  # NOTE: numpy reads read-only message bytes without a copy
            assert self._np is not None
            self._np[layer, :, a:b] = np.frombuffer(data, dtype=np.uint8).reshape(
                2, b - a, self.row
            )
        self.covered[layer, a:b] = True
        self.seq += 1
        last = self.fp.num_layers - 1
        if self.on_layers is not None and layer == last and self.covered[last].all():
            self.on_layers()
            self.on_layers = None

    def finish(self, t: pb.KVHeader) -> tuple[KVHandle, float]:
        """The handle, from the trailer ``t``, and the sender's ``finished_unix``."""
        if t.num_chunks != self.seq:
            raise TransferError(f"trailer counts {t.num_chunks} pieces, {self.seq} arrived")
        if t.num_computed != self.n_tokens or t.num_blocks != self.n_blocks:
            raise TransferError("trailer and header disagree on the KV's size")
        if not self.covered.all():
            layer = int(np.argmin(self.covered.all(axis=1)))
            raise TransferError(f"layer {layer} is missing positions")
        t.total_bytes = self.buf.numel()
        return handle_from(t, self.buf, self.fp), t.finished_unix


def decode_stream(
    messages: Iterable[bytes],
    expected: LayoutFingerprint,
    on_layers: Callable[[], None] | None = None,
) -> tuple[KVHandle, float]:
    """Rebuild a handle from a ``StreamKV`` stream (``StreamAssembler``, ``on_layers`` as
    there); returns it and the sender's ``finished_unix``. Every piece must pass its
    checksum."""
    it = iter(messages)
    raw = next(it, None)
    first = pb.StreamKVResponse.FromString(raw) if raw is not None else None
    if first is None or first.WhichOneof("msg") != "header":
        raise TransferError("stream did not start with a header")
    asm = StreamAssembler(first.header, expected, on_layers=on_layers)
    for raw in it:
        frame = read_data_frame(raw, 2)
        if frame is None:
            msg = pb.StreamKVResponse.FromString(raw)
            kind = msg.WhichOneof("msg")
            if kind == "heartbeat":  # the sender waits for its prefill: progress all the same
                continue
            if kind != "trailer":
                raise TransferError(
                    f"a {kind or 'empty message'} where a piece or the trailer was due"
                )
            return asm.finish(msg.trailer)
        f, data = frame
        seq, layer, a, b = f.get(1, 0), f.get(2, 0), f.get(3, 0), f.get(4, 0)
        asm.check(seq, layer, a, b, len(data))
        check_frame(f, data, PIECE_CRC, f"piece {seq}")
        asm.place(layer, a, b, data)
    raise TransferError(f"stream ended after {asm.seq} pieces, without its trailer")
