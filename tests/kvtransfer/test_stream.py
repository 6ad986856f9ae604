"""The layer-wise stream contract (every transport streams: grpc, shm, gloo for nccl): a stream fed
while the receiver reads gives byte-exact KV, and ends once the sender finishes; a
corrupted piece, a failed prefill, a stalled, stopped or killed sender, a wrong layout, an unknown
request and a second receiver all fail cleanly; concurrent streams from one sender do not
wait for each other."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

import kvtransfer.stream
from kvtransfer.stream import StreamBuffer, StreamFailedError, piece_bytes
from kvtransfer.transport import get_transport
from kvtransfer.wire import TransferError
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from tests.fixtures import eventually
from tests.kvtransfer import sender_proc
from tests.kvtransfer.kv_fixtures import DictSource, feed, iter_pieces, random_handle

LAYOUTS = [
    dict(),
    dict(layers=30, kv_heads=3, head_dim=64, block_size=16, n_blocks=9),  # SmolLM2's layout
    dict(dtype="bfloat16", n_blocks=33),
    dict(dtype="float16", n_blocks=1, block_size=1),
    dict(dtype="int8", head_dim=64, n_blocks=7),  # uint8 rows: values and per-32 scales
]


@pytest.fixture(params=["grpc", "shm", "gloo"])
def transport(request):
    t = get_transport(request.param)
    assert t.streaming
    client = t.client()
    yield t, client
    client.close()


def _same_kv(got, h) -> bool:
    n = h.num_computed
    return torch.equal(got.blocks.flatten(2, 3)[:, :, :n], h.blocks.flatten(2, 3)[:, :, :n])


def _pull_in_thread(client, address, rid, fp, timeout_s=20.0, stall_s=None):
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = client.pull_stream(address, rid, fp, timeout_s, stall_s)
        except Exception as e:
            box["error"] = e
        box["at"] = time.time()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_streamed_kv_is_byte_exact_while_the_sender_feeds_it(transport, layout):
    t, client = transport
    h = random_handle(**LAYOUTS[layout])
    src = DictSource({})
    # a piece is at most 512 bytes here: long layers are split into several frames
    server = t.serve(src, "127.0.0.1", 0, chunk_bytes=512)
    try:
        stream = src.open_stream(h)
        th, box = _pull_in_thread(client, server.address, h.request_id, h.fingerprint)
        # the receiver is waiting before the first layer exists
        eventually(lambda: src.attached, 10, "the receiver attached")
        feed(stream, h, chunks=3, delay_s=0.01).join()
        th.join(20)
        got, finished_unix = box["result"]
        client.release(server.address, h.request_id, 5)
    finally:
        server.stop()
    n = h.num_computed  # the last block's unused tail is not KV: it arrives as zeros
    assert torch.equal(got.blocks.flatten(2, 3)[:, :, :n], h.blocks.flatten(2, 3)[:, :, :n])
    assert not got.blocks.flatten(2, 3)[:, :, n:].any()
    assert dataclasses.replace(got, blocks=h.blocks) == h
    assert box["at"] >= finished_unix  # the receiver returned only once the sender finished
    assert src.released == [h.request_id] and not src.streams


def test_a_receiver_that_comes_late_gets_everything(transport):
    t, client = transport
    h = random_handle(n_blocks=7)
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        feed(src.open_stream(h), h, chunks=2).join()  # all done before anyone asked
        got, _ = client.pull_stream(server.address, h.request_id, h.fingerprint, 10)
    finally:
        server.stop()
    assert _same_kv(got, h)


def test_a_stream_past_the_buffer_bound_spills_and_still_arrives_byte_exact(transport):
    t, client = transport
    h = random_handle(n_blocks=7)
    layer_piece = piece_bytes(next(iter_pieces(h, chunks=2)))
    buffer = StreamBuffer(2 * layer_piece)  # room for two of the six pieces
    src = DictSource({h.request_id: h})  # the held KV the spilled stream refills from
    server = t.serve(src, "127.0.0.1", 0)
    try:
        stream = src.open_stream(h, buffer)
        feed(stream, h, chunks=2).join()  # nobody reads yet: the third piece spills
        assert stream.spilled and buffer.spilled == 1 and buffer.used == 0
        got, _ = client.pull_stream(server.address, h.request_id, h.fingerprint, 10)
    finally:
        server.stop()
    assert _same_kv(got, h) and buffer.used == 0


def test_pieces_sent_before_a_spill_stay_valid_and_the_bound_is_given_back():
    h = random_handle(layers=2, n_blocks=4)
    pieces = list(iter_pieces(h, chunks=2))  # layer 0, 1 of the first half; then the second
    buffer = StreamBuffer(piece_bytes(pieces[0]))  # one piece at a time
    src = DictSource({h.request_id: h})
    stream = src.open_stream(h, buffer)
    stream.attach()
    events = stream.events(time.monotonic() + 10)
    stream.put(pieces[0])
    assert next(events) is pieces[0]  # in flight: still counted
    assert buffer.used == piece_bytes(pieces[0])
    stream.put(pieces[1])  # over the bound while piece 0 is being sent: spills
    for p in pieces[2:]:
        stream.put(p)  # ignored: the end refills every layer
    stream.finish(dataclasses.replace(h, blocks=torch.empty(0)))
    rest = list(events)
    assert buffer.used == 0 and buffer.spilled == 1
    assert [(p.layer, p.token_start, p.token_end) for p in rest[:-1]] == [
        (0, 0, h.num_computed), (1, 0, h.num_computed),
    ]  # fmt: skip
    flat = h.blocks.flatten(2, 3)
    for p in rest[:-1]:
        assert torch.equal(p.data, flat[p.layer, :, : h.num_computed])
    assert rest[-1].blocks.numel() == 0  # the data-less final handle still ends it


def test_a_spilled_stream_whose_hold_ended_fails():
    h = random_handle(n_blocks=3)
    src = DictSource({})  # the held KV is gone (released or expired) before the end is sent
    stream = src.open_stream(h, StreamBuffer(0))
    stream.attach()
    feed(stream, h).join()
    with pytest.raises(StreamFailedError, match="no longer held"):
        list(stream.events(time.monotonic() + 10))


@pytest.fixture
def fast_heartbeats(monkeypatch):
    monkeypatch.setattr(kvtransfer.stream, "HEARTBEAT_S", 0.1)


def test_heartbeats_keep_a_queued_prefill_s_stream_alive_past_the_stall_timeout(
    transport, fast_heartbeats
):
    t, client = transport
    h = random_handle(n_blocks=5)
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        stream = src.open_stream(h)
        th, box = _pull_in_thread(client, server.address, h.request_id, h.fingerprint, stall_s=0.6)
        # the prefill waits 1.5 s in its engine's queue (simulated time, not synchronization):
        # no piece comes, only heartbeats
        time.sleep(1.5)
        feed(stream, h).join()
        th.join(20)
    finally:
        server.stop()
    assert "error" not in box, box
    assert _same_kv(box["result"][0], h)


def test_a_stream_whose_sender_makes_no_progress_fails_at_the_stall_timeout(
    transport, fast_heartbeats
):
    t, client = transport
    h = random_handle(n_blocks=5)
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        src.open_stream(h, progressing=lambda: False)  # a stalled engine: no heartbeats
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"no progress for 0\.6 s"):
            client.pull_stream(server.address, h.request_id, h.fingerprint, 20, stall_s=0.6)
        assert time.monotonic() - start < 10  # the stall timeout, long before the deadline
    finally:
        server.stop()


def test_a_corrupted_piece_is_detected(transport):
    t, client = transport
    h = random_handle(n_blocks=8)

    def damage(msg: pb.StreamKVResponse) -> pb.StreamKVResponse:
        if msg.WhichOneof("msg") == "piece" and msg.piece.seq == 2:
            data = bytearray(msg.piece.data)
            data[3] ^= 0x10
            msg.piece.data = bytes(data)
        return msg

    def damage_chunk(seq: int, part: torch.Tensor) -> torch.Tensor:
        if seq != 2:
            return part
        part = part.clone()
        part[3] ^= 0x10
        return part

    hook = {"chunk_hook": damage_chunk} if t.name == "gloo" else {"message_hook": damage}
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0, **hook)
    try:
        feed(src.open_stream(h), h).join()
        with pytest.raises(TransferError, match=r"piece 2 failed its (CRC-32|crc32c?) check"):
            client.pull_stream(server.address, h.request_id, h.fingerprint, 10)
    finally:
        server.stop()


def test_a_prefill_that_ends_without_kv_fails_the_stream(transport):
    t, client = transport
    h = random_handle(n_blocks=8)
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        stream = src.open_stream(h)
        th, box = _pull_in_thread(client, server.address, h.request_id, h.fingerprint)
        feed(stream, h, delay_s=0.01, fail_at=4).join()
        th.join(10)
    finally:
        server.stop()
    assert isinstance(box["error"], StreamFailedError)
    assert "aborted" in str(box["error"])


def test_a_stalled_sender_hits_the_deadline_and_a_stopped_one_fails(transport):
    t, client = transport
    h = random_handle(n_blocks=8)
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        src.open_stream(h)  # never fed: the prefill is stuck
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            client.pull_stream(server.address, h.request_id, h.fingerprint, 1.0)
        assert time.monotonic() - t0 < 5.0
        other = dataclasses.replace(h, request_id="r2")
        stream = src.open_stream(other)
        th, box = _pull_in_thread(client, server.address, "r2", h.fingerprint)
        feed(stream, other, delay_s=0.3)  # slow: the sender goes away mid-stream
        eventually(lambda: len(src.attached) == 2, 10, "the second receiver attached")
    finally:
        server.stop()
    th.join(10)
    assert isinstance(box.get("error"), TransferError)


def test_wrong_layout_unknown_request_and_a_second_receiver_are_refused(transport):
    t, client = transport
    h = random_handle()
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        stream = src.open_stream(h)
        wrong = dataclasses.replace(h.fingerprint, head_dim=16)
        with pytest.raises(LayoutMismatchError, match="head_dim"):
            client.pull_stream(server.address, h.request_id, wrong, 5)
        with pytest.raises(UnknownRequestError):
            client.pull_stream(server.address, "nope", h.fingerprint, 5)
        th, box = _pull_in_thread(client, server.address, h.request_id, h.fingerprint)
        eventually(lambda: src.attached, 10, "the first receiver attached")
        with pytest.raises(TransferError, match="has a receiver"):
            client.pull_stream(server.address, h.request_id, h.fingerprint, 5)
        feed(stream, h).join()
        th.join(10)
        assert _same_kv(box["result"][0], h)  # the first receiver is unaffected
    finally:
        server.stop()


def test_concurrent_streams_from_one_sender_do_not_wait_for_each_other(transport):
    """A stream holds its connection (a gloo pair) for the whole prefill: a second request's
    stream to the same sender must still arrive while the first one is unfinished."""
    t, client = transport
    first, second = random_handle(n_blocks=6), dataclasses.replace(random_handle(), request_id="r2")
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    try:
        s1, s2 = src.open_stream(first), src.open_stream(second)
        th1, box1 = _pull_in_thread(client, server.address, first.request_id, first.fingerprint)
        # the first receiver is attached and waiting for its prefill
        eventually(lambda: src.attached, 10, "the first receiver attached")
        th2, box2 = _pull_in_thread(client, server.address, "r2", second.fingerprint)
        feed(s2, second).join()
        th2.join(10)
        assert "result" in box2 and _same_kv(box2["result"][0], second)
        assert th1.is_alive() and not box1  # the first is still waiting for its prefill
        feed(s1, first).join()
        th1.join(10)
        assert _same_kv(box1["result"][0], first)
    finally:
        server.stop()
    assert len(src.attached) == 2 and src.attached[0]  # the first attached while it ran


def test_a_gloo_stream_waits_past_the_group_timeout_for_a_queued_prefill():
    """A prefill may queue for longer than the pair's group timeout before its first piece:
    the receiver waits on its own deadline, not the group's."""
    from kvtransfer.dist_transport import DistKVClient, DistKVServer

    h = random_handle(n_blocks=4)
    src = DictSource({})
    server = DistKVServer(src, "127.0.0.1", 0, "gloo", timeout_s=1.0)
    client = DistKVClient("gloo", connect_timeout_s=1.0)
    try:
        stream = src.open_stream(h)
        threading.Timer(2.5, lambda: feed(stream, h)).start()
        got, _ = client.pull_stream(server.address, h.request_id, h.fingerprint, 10)
        assert _same_kv(got, h)
    finally:
        client.close()
        server.stop()


def test_a_killed_sender_fails_the_stream_at_once_and_leaves_nothing(transport):
    t, client = transport
    proc, address = sender_proc.start(t.name, 40, "stream")
    try:
        fp = random_handle(layers=30, kv_heads=3, head_dim=64, block_size=16).fingerprint
        threading.Timer(1.5, proc.kill).start()  # mid-stream: a piece per 0.2 s, 120 pieces
        # the broken connection fails it (TransferError), not the 60 s deadline (TimeoutError)
        with pytest.raises(TransferError):
            client.pull_stream(address, "r", fp, timeout_s=60)
    finally:
        proc.kill()
        proc.wait()
    assert getattr(client, "num_pairs", 0) == 0  # gloo: the broken pair is closed


def test_gloo_pairs_per_peer_bound_concurrent_streams():
    """At most ``pairs_per_peer`` pairs to one sender: a third concurrent stream waits for a
    pair to free up, then arrives intact."""
    from kvtransfer.dist_transport import DistKVClient

    t = get_transport("gloo")
    handles = [dataclasses.replace(random_handle(), request_id=f"r{i}") for i in range(3)]
    src = DictSource({})
    server = t.serve(src, "127.0.0.1", 0)
    client = DistKVClient("gloo", pairs_per_peer=2)
    try:
        streams = [src.open_stream(h) for h in handles]
        pulls = []
        for i, h in enumerate(handles):
            pulls.append(_pull_in_thread(client, server.address, h.request_id, h.fingerprint))
            if i < 2:
                eventually(lambda i=i: len(src.attached) == i + 1, 10, f"stream {i} attached")
        eventually(lambda: client.transfers_waiting == 1, 10, "the third to wait for a pair")
        assert client.num_pairs == 2 and len(src.attached) == 2
        for stream, h, (th, box) in zip(streams, handles, pulls, strict=True):
            feed(stream, h).join()
            th.join(10)
            assert _same_kv(box["result"][0], h)
        assert client.num_pairs == 2 and len(src.attached) == 3
    finally:
        client.close()
        server.stop()
