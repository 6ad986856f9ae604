"""The gRPC KV transport over a real server on loopback."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtransfer.grpc_transport import GrpcKVClient, GrpcKVServer
from kvtransfer.outbox import Outbox, OutboxConfig
from kvtransfer.transport import get_transport
from kvtransfer.wire import TransferError
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.sampling_params import SamplingParams
from tests.kvtransfer.kv_fixtures import DictSource, random_handle

REPO = Path(__file__).resolve().parents[2]


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
        dict(dtype="int8", head_dim=64, n_blocks=7),
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
    outbox = Outbox(pre.fingerprint, lambda: lock)
    server = get_transport("grpc").serve(outbox)
    try:
        entry = outbox.open("r", len(prompt), False)
        with lock:
            pre.add_request("r", prompt, params, kv_sink=entry)
            while pre.has_unfinished:
                pre.step()
        assert pre.stats().num_held == 1
        handle = client.pull(server.address, "r", dec.fingerprint, 10, secret=entry.secret)
        client.release(server.address, "r", 5, secret=entry.secret)
        client.release(server.address, "r", 5, secret=entry.secret)  # idempotent
        assert pre.blocks.num_used_blocks == 0
    finally:
        server.stop()
    dec.add_request("r", prompt, params, kv_handle=handle)
    got = []
    while dec.has_unfinished:
        got += [t for o in dec.step() for t in o.new_token_ids]
    assert [handle.token_ids[-1], *got] == solo


@pytest.mark.parametrize("buffer_mb", [None, 0, 64])  # unbounded, always spills, room enough
def test_an_engine_stream_within_its_buffer_bound_gives_solo_tokens(make_engine, client, buffer_mb):
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    (solo,) = make_engine().generate([prompt], params)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    lock = threading.Lock()
    cap = None if buffer_mb is None else buffer_mb << 20
    outbox = Outbox(pre.fingerprint, lambda: lock, OutboxConfig(stream_buffer_bytes=cap))
    server = get_transport("grpc").serve(outbox)
    try:
        entry = outbox.open("r", len(prompt), stream=True)
        with lock:  # the receiver attaches late: every piece is queued first
            pre.add_request("r", prompt, params, kv_sink=entry)
            while pre.has_unfinished:
                pre.step()
        handle, _ = client.pull_stream(
            server.address, "r", dec.fingerprint, 10, secret=entry.secret
        )
        client.release(server.address, "r", 5, secret=entry.secret)
        stats = outbox.stats()
        assert stats["held"] == 0 and stats["late"] == 1 and pre.blocks.num_used_blocks == 0
        if buffer_mb is not None:
            assert stats["spilled"] == (buffer_mb == 0) and stats["queued_bytes"] == 0
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
