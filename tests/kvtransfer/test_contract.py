"""The contract every KV transport keeps (gloo stands in for NCCL on CPU): byte-exact round
trips for several layouts and dtypes, a corrupted chunk detected, a killed sender failing the
pull within its deadline with nothing left behind, a mismatched layout or unknown request
refused cleanly, release freeing the sender's blocks."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kvtransfer import shm, wire
from kvtransfer.transport import get_transport
from kvtransfer.wire import TransferError
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from tests.fixtures import eventually
from tests.kvtransfer import sender_proc
from tests.kvtransfer.kv_fixtures import DictSource, random_handle

TRANSPORTS = ["grpc", "shm", "gloo"]


def _segments() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob("pdserve-kv-*")}


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    t = get_transport(request.param)
    client = t.client()
    yield t, client
    client.close()


LAYOUTS = [
    dict(),
    dict(layers=30, kv_heads=3, head_dim=64, block_size=16, n_blocks=9),  # SmolLM2's layout
    dict(dtype="bfloat16", n_blocks=33),
    dict(dtype="float16", n_blocks=1, block_size=1),
    dict(dtype="int8", head_dim=64, n_blocks=7),  # uint8 rows: values and per-32 scales
]


def test_round_trips_are_byte_exact(transport):
    t, client = transport
    for i, layout in enumerate(LAYOUTS):
        h = dataclasses.replace(random_handle(**layout), request_id=f"r{i}")
        server = t.serve(DictSource({f"r{i}": h}), "127.0.0.1", 0, chunk_bytes=1000 + 4096 * i)
        try:
            got = client.pull(server.address, f"r{i}", h.fingerprint, timeout_s=20)
        finally:
            server.stop()
        assert torch.equal(got.blocks.view(torch.uint8), h.blocks.contiguous().view(torch.uint8))
        assert dataclasses.replace(got, blocks=h.blocks) == h
    assert not _segments()  # shm: a stopped sender unlinks its segments


def _corrupting(name: str):  # type: ignore[no-untyped-def]
    """Server options that damage the payload in flight (chunk 1, or the shared segment)."""
    if name == "gloo":

        def chunk_hook(seq: int, chunk: torch.Tensor) -> torch.Tensor:
            if seq != 1:
                return chunk
            bad = chunk.clone()
            bad[7] ^= 0x40
            return bad

        return {"chunk_hook": chunk_hook}

    header: list[pb.KVHeader] = []

    def message_hook(msg: pb.PullKVResponse) -> pb.PullKVResponse:
        if msg.WhichOneof("msg") == "header":
            header.append(msg.header)
        elif msg.chunk.seq == 1 and msg.chunk.data:
            data = bytearray(msg.chunk.data)
            data[7] ^= 0x40
            msg.chunk.data = bytes(data)
        elif msg.chunk.seq == 1:  # shm: chunk 1 is in the segment, announced, not yet read
            with open(shm.SHM_DIR / header[0].shm_name, "r+b") as f:
                f.seek(header[0].chunk_bytes + 7)
                b = f.read(1)
                f.seek(header[0].chunk_bytes + 7)
                f.write(bytes([b[0] ^ 0x40]))
        return msg

    return {"message_hook": message_hook}


def test_a_corrupted_chunk_is_detected(transport):
    t, client = transport
    h = random_handle(n_blocks=8)
    server = t.serve(DictSource({"r": h}), "127.0.0.1", 0, chunk_bytes=512, **_corrupting(t.name))
    try:
        # the chunk's own checksum: in its message, or (shm) in its notice, checked on the copy
        with pytest.raises(TransferError, match=r"chunk 1 failed its (CRC-32|crc32c?) check"):
            client.pull(server.address, "r", h.fingerprint, timeout_s=10)
    finally:
        server.stop()


def test_mismatched_layout_and_unknown_requests_are_refused_and_release_frees(transport):
    t, client = transport
    h = random_handle()
    source = DictSource({"r": h})
    server = t.serve(source, "127.0.0.1", 0)
    try:
        with pytest.raises(LayoutMismatchError, match="block_size: 4 != 8"):
            client.pull(server.address, "r", dataclasses.replace(h.fingerprint, block_size=8), 10)
        with pytest.raises(UnknownRequestError):
            client.pull(server.address, "nope", h.fingerprint, 10)
        got = client.pull(server.address, "r", h.fingerprint, 10)  # the connection is still good
        assert torch.equal(got.blocks, h.blocks)
        client.release(server.address, "r", 5)
        assert source.released == ["r"]
        with pytest.raises(UnknownRequestError):
            client.pull(server.address, "r", h.fingerprint, 10)
    finally:
        server.stop()
    assert not _segments()


def test_a_killed_sender_fails_the_pull_within_its_deadline(transport):
    t, client = transport
    before = _segments()
    proc, address = sender_proc.start(t.name, 400)  # ~92 MB
    try:
        fp = random_handle(
            layers=30, kv_heads=3, head_dim=64, block_size=16, n_blocks=400
        ).fingerprint
        import threading

        threading.Timer(1.5, proc.kill).start()  # mid-transfer: it sends a chunk per 0.2 s
        t0 = time.monotonic()
        with pytest.raises((TransferError, TimeoutError)):
            client.pull(address, "r", fp, timeout_s=20)
        assert time.monotonic() - t0 < 20 + 2  # gave up by the deadline at the latest
    finally:
        proc.kill()
        proc.wait()
    # nothing kept for the dead peer; and the client still works against a live sender,
    # which first sweeps any segment the dead one wrote but never handed over
    assert getattr(client, "num_pairs", 0) == 0
    h = random_handle()
    server = t.serve(DictSource({"r": h}), "127.0.0.1", 0)
    assert _segments() <= before
    try:
        assert torch.equal(client.pull(server.address, "r", h.fingerprint, 10).blocks, h.blocks)
    finally:
        server.stop()


def test_dist_pairs_are_lazy_reused_bounded_and_evicted_when_idle():
    from kvtransfer.dist_transport import DistKVClient

    t = get_transport("gloo")
    h = random_handle()
    servers = [t.serve(DictSource({"r": h}), "127.0.0.1", 0) for _ in range(2)]
    client = DistKVClient("gloo", max_pairs=1, idle_s=0.5)
    try:
        assert client.num_pairs == 0  # nothing until the first pull
        for _ in range(3):
            client.pull(servers[0].address, "r", h.fingerprint, 10)
        assert client.num_pairs == 1
        deadline = time.monotonic() + 5  # NOTE: one 5 s budget for the three waits together
        eventually(
            lambda: servers[0].pairs_open == 1,
            deadline - time.monotonic(),
            "the sender's pair open",
        )
        client.pull(servers[1].address, "r", h.fingerprint, 10)  # bound 1: the first pair goes
        assert client.num_pairs == 1
        eventually(
            lambda: servers[0].pairs_open == 0,
            deadline - time.monotonic(),
            "the evicted pair closed on the sender",
        )
        time.sleep(0.6)
        client.pull(servers[0].address, "r", h.fingerprint, 10)  # idle pair closed, new one made
        eventually(
            lambda: servers[1].pairs_open == 0,
            deadline - time.monotonic(),
            "the idle pair closed on the sender",
        )
    finally:
        client.close()
        for s in servers:
            s.stop()


def test_shm_is_used_only_on_the_same_host():
    from kvtransfer.grpc_transport import GrpcKVClient

    t = get_transport("shm")
    h = random_handle(n_blocks=20)
    seen = []

    def spy(msg: pb.PullKVResponse) -> pb.PullKVResponse:
        kind = msg.WhichOneof("msg")
        if kind == "header" and msg.header.shm_name:
            kind = "shm"
        elif kind == "chunk" and not msg.chunk.data:
            kind = "notice"  # a chunk in the segment, announced with its checksum
        seen.append(kind)
        return msg

    server = t.serve(DictSource({"r": h}), "127.0.0.1", 0, message_hook=spy)
    try:
        local = t.client()
        assert torch.equal(local.pull(server.address, "r", h.fingerprint, 10).blocks, h.blocks)
        assert seen == ["shm", "notice"]
        seen.clear()
        remote = GrpcKVClient(shared_memory=True)
        remote.host_id = "another-host"  # as a receiver on another node would say
        assert torch.equal(remote.pull(server.address, "r", h.fingerprint, 10).blocks, h.blocks)
        assert seen[0] == "header" and set(seen[1:]) == {"chunk"}
    finally:
        server.stop()
    assert not _segments()


def test_nccl_without_gpus_fails_loudly_at_start():
    from kvtransfer.dist_transport import TransportUnavailableError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: NCCL can work")
    with pytest.raises(TransportUnavailableError, match="nccl needs CUDA"):
        get_transport("nccl")


def test_shm_segments_are_reused_and_a_reused_one_fails_a_late_receiver():
    t = get_transport("shm")
    a = random_handle(n_blocks=20)
    b = dataclasses.replace(a, blocks=torch.randn_like(a.blocks))
    handles = {
        f"{k}{i}": dataclasses.replace(h, request_id=f"{k}{i}")
        for i in range(3)
        for k, h in (("a", a), ("b", b))
    }
    sent: dict[str, list[bytes]] = {}

    def keep(msg: pb.PullKVResponse) -> pb.PullKVResponse:
        if msg.WhichOneof("msg") == "header":
            sent[msg.header.request_id] = []
        list(sent.values())[-1].append(msg.SerializeToString())
        return msg

    server = t.serve(DictSource(dict(handles)), "127.0.0.1", 0, message_hook=keep, chunk_bytes=4096)
    client = t.client()
    try:
        for rid, h in handles.items():  # one after another, each released before the next
            got = client.pull(server.address, rid, h.fingerprint, 10)
            assert torch.equal(got.blocks, h.blocks)
            client.release(server.address, rid, 5)
        assert server.segments.created == 1 and len(server.segments.names) == 1
        assert len(sent["a2"]) == 1 + 8  # the header, then a notice per chunk
        # a receiver that reads "a2"'s notices only now, after the segment carried "b2":
        # its checksums fail, it never returns b's bytes as a's
        with pytest.raises(TransferError, match="chunk 0 failed its crc32c check"):
            wire.decode(iter(sent["a2"]), a.fingerprint, shm.SegmentReader())
        # and one that did not offer shared memory refuses the handover
        with pytest.raises(TransferError, match="segment nobody asked for"):
            wire.decode(iter(sent["b2"]), b.fingerprint)
    finally:
        client.close()
        server.stop()
    assert not _segments()


def test_shm_segments_of_unreleased_pulls_go_back_at_their_lease():
    segs = shm.Segments(lease_s=0.2, max_free_bytes=4 << 20)
    try:
        first, _ = segs.reserve("r1", 100)
        second, _ = segs.reserve("r2", 100)
        assert second != first  # r1 still leased
        time.sleep(0.3)
        segs.expire()
        assert segs.expired == 2
        assert segs.reserve("r3", 100)[0] in {first, second}  # an expired lease's segment
        assert len(segs.names) == 2 and segs.created == 2  # reused, not a third
        twice = {segs.reserve("r3", 100)[0], segs.reserve("r3", 100)[0]}
        assert len(twice) == 2  # a request pulled twice holds two segments
        made = segs.names | {segs.reserve("big", 6 << 20)[0]}
        assert len(made) == 4 and made <= _segments()
        segs.release("r3")
        segs.release("big")  # 2 + 2 + 2 + 6 MiB free, bound 4 MiB: the oldest go first
        assert len(segs.names) == 0 and not (made & _segments())
        held = made
    finally:
        segs.close()
    assert not (held & _segments()) and not segs.names
