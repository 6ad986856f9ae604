"""The gRPC KV transport over a real server on loopback."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtransfer.grpc_transport import GrpcKVClient, GrpcKVServer
from kvtransfer.source import EngineKVSource
from kvtransfer.transport import get_transport
from kvtransfer.wire import TransferError
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]


class DictSource:
    def __init__(self, handles: dict[str, KVHandle], delay_s: float = 0.0) -> None:
        self.handles = handles
        self.released: list[str] = []
        self.delay_s = delay_s

    def get(self, request_id):
        time.sleep(self.delay_s)
        return self.handles.get(request_id)

    def release(self, request_id):
        self.released.append(request_id)
        self.handles.pop(request_id, None)


def random_handle(layers=3, kv_heads=2, head_dim=8, block_size=4, n_blocks=5, dtype="float32"):
    fp = LayoutFingerprint("m", layers, kv_heads, head_dim, block_size, dtype)
    blocks = torch.randn(layers, 2, n_blocks, block_size, kv_heads, head_dim).to(
        getattr(torch, dtype)
    )
    n_tokens = n_blocks * block_size - 1
    return KVHandle(
        "r", tuple(range(n_tokens + 1)), n_tokens, fp, (b"h" * 16,) * (n_blocks - 1), blocks, -0.5
    )


@pytest.fixture
def client():
    c = GrpcKVClient()
    yield c
    c.close()


@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(layers=30, kv_heads=3, head_dim=64, block_size=16, n_blocks=9),  # SmolLM2's layout
        dict(dtype="bfloat16"),
        dict(dtype="float16", n_blocks=1, block_size=1),
    ],
)
@pytest.mark.parametrize("chunk_bytes", [1000, 1 << 20])
def test_round_trip_is_byte_exact(client, layout, chunk_bytes):
    h = random_handle(**layout)
    server = GrpcKVServer(DictSource({"r": h}), chunk_bytes=chunk_bytes)
    try:
        got = client.pull(server.address, "r", h.fingerprint, timeout_s=10)
    finally:
        server.stop()
    assert torch.equal(got.blocks.view(torch.uint8), h.blocks.contiguous().view(torch.uint8))
    assert dataclasses.replace(got, blocks=h.blocks) == dataclasses.replace(h)


def test_corrupted_chunk_is_detected(client):
    h = random_handle(n_blocks=8)

    def flip(msg: pb.PullKVResponse) -> pb.PullKVResponse:
        if msg.WhichOneof("msg") == "chunk" and msg.chunk.seq == 1:
            data = bytearray(msg.chunk.data)
            data[7] ^= 0x40
            msg.chunk.data = bytes(data)
        return msg

    server = GrpcKVServer(DictSource({"r": h}), chunk_bytes=512, message_hook=flip)
    try:
        with pytest.raises(TransferError, match="chunk 1 failed its CRC-32"):
            client.pull(server.address, "r", h.fingerprint, timeout_s=10)
    finally:
        server.stop()


def test_mismatched_layout_unknown_request_and_deadline(client):
    h = random_handle()
    source = DictSource({"r": h})
    server = GrpcKVServer(source)
    slow = GrpcKVServer(DictSource({"r": h}, delay_s=2.0))
    try:
        with pytest.raises(LayoutMismatchError, match="block_size: 4 != 8"):
            client.pull(server.address, "r", dataclasses.replace(h.fingerprint, block_size=8), 10)
        with pytest.raises(UnknownRequestError, match="nope"):
            client.pull(server.address, "nope", h.fingerprint, 10)
        t = time.perf_counter()
        with pytest.raises(TimeoutError):
            client.pull(slow.address, "r", h.fingerprint, timeout_s=0.3)
        assert time.perf_counter() - t < 3  # the deadline holds: no wait on the slow sender
        client.release(server.address, "r", 5)
        assert source.released == ["r"]
        with pytest.raises(UnknownRequestError):
            client.pull(server.address, "r", h.fingerprint, 10)
    finally:
        server.stop()
        slow.stop(grace_s=0)


def test_dead_sender_fails_the_pull_without_hanging(client):
    h = random_handle()
    server = GrpcKVServer(DictSource({"r": h}))
    address = server.address
    server.stop(grace_s=0)
    t = time.perf_counter()
    with pytest.raises((TransferError, TimeoutError)):
        client.pull(address, "r", h.fingerprint, timeout_s=2)
    assert time.perf_counter() - t < 10  # bounded: never waits forever


def test_engine_handoff_over_grpc_gives_solo_tokens(make_engine, client):
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    (solo,) = make_engine().generate([prompt], params)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    lock = threading.Lock()
    server = get_transport("grpc").serve(EngineKVSource(pre, lock))
    try:
        with lock:
            pre.add_request("r", prompt, params)
            while pre.has_unfinished:
                pre.step()
        handle = client.pull(server.address, "r", dec.fingerprint, timeout_s=10)
        client.release(server.address, "r", 5)
        client.release(server.address, "r", 5)  # idempotent
        assert pre.blocks.num_used_blocks == 0
    finally:
        server.stop()
    dec.add_request("r", prompt, params, kv_handle=handle)
    got = []
    while dec.has_unfinished:
        got += [t for o in dec.step() for t in o.new_token_ids]
    assert [handle.token_ids[-1], *got] == solo


def test_transport_registry_names_valid_choices():
    with pytest.raises(ValueError, match="choose one of: grpc"):
        get_transport("carrier-pigeon")
