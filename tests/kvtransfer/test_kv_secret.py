"""The KV plane's capability over real servers on loopback: every transport refuses a known
request's KV to a caller without its transfer's secret (PERMISSION_DENIED, counted), changes
nothing for it, and serves the holder of the secret as before."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtransfer.base import PermissionDeniedError
from kvtransfer.outbox import Handoff, Outbox
from kvtransfer.transport import get_transport
from tests.kvtransfer.kv_fixtures import iter_pieces, random_handle


class Pinned:
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks, self.frees = blocks, 0

    def read(self) -> torch.Tensor:
        return self.blocks.clone()

    def free(self) -> None:
        self.frees += 1


@pytest.fixture(params=["grpc", "shm", "gloo"])
def served(request):
    lock = threading.Lock()
    h = random_handle()
    outbox = Outbox(h.fingerprint, lambda: lock)
    t = get_transport(request.param)
    server = t.serve(outbox, "127.0.0.1", 0)
    client = t.client()
    yield outbox, lock, h, server, client
    client.close()
    server.stop()


def _held(outbox, lock, h, rid, stream):
    entry = outbox.open(rid, h.num_computed, stream)
    pinned = Pinned(h.blocks)
    with lock:
        for piece in iter_pieces(h) if stream else ():
            entry.layer_computed(piece)
        assert entry.prefilled(h, pinned)
    return entry, pinned


@pytest.mark.parametrize("wrong", ["", "not-the-secret"])
def test_every_call_without_the_secret_is_denied(served, wrong):
    outbox, lock, h, server, client = served
    entry, pinned = _held(outbox, lock, h, "r", stream=True)
    with pytest.raises(PermissionDeniedError):
        client.pull(server.address, "r", h.fingerprint, 10, secret=wrong)
    with pytest.raises(PermissionDeniedError):
        client.pull_stream(server.address, "r", h.fingerprint, 10, secret=wrong)
    with pytest.raises(PermissionDeniedError):
        client.release(server.address, "r", 5, secret=wrong)
    assert outbox.stats()["denied"] == 3
    assert outbox.state("r") is Handoff.HELD and pinned.frees == 0  # nothing changed
    # the holder of the ref is served as before, on the same client and connection
    got, _ = client.pull_stream(server.address, "r", h.fingerprint, 10, secret=entry.secret)
    n = h.num_computed
    assert torch.equal(got.blocks.flatten(2, 3)[:, :, :n], h.blocks.flatten(2, 3)[:, :, :n])
    client.release(server.address, "r", 5, secret=entry.secret)
    assert pinned.frees == 1 and outbox.state("r") is None


def test_a_whole_pull_needs_the_secret_too(served):
    outbox, lock, h, server, client = served
    entry, _ = _held(outbox, lock, h, "w", stream=False)
    with pytest.raises(PermissionDeniedError):
        client.pull(server.address, "w", h.fingerprint, 10, secret="guess")
    got = client.pull(server.address, "w", h.fingerprint, 10, secret=entry.secret)
    assert torch.equal(got.blocks, h.blocks)
    client.release(server.address, "w", 5, secret=entry.secret)


def test_the_dist_rendezvous_namespace_is_not_guessable():
    """gloo / nccl: the TCPStore has no access control and cannot list keys, so every key
    lives under a random namespace that only the address (in KVRefs) carries."""
    h = random_handle()
    outbox = Outbox(h.fingerprint, lambda: threading.Lock())
    server = get_transport("gloo").serve(outbox, "127.0.0.1", 0)
    other = get_transport("gloo").serve(outbox, "127.0.0.1", 0)
    try:
        hostport, _, ns = server.address.partition("/")
        assert len(ns) == 32 and int(ns, 16) >= 0 and hostport.startswith("127.0.0.1:")
        assert other.address.partition("/")[2] != ns
    finally:
        server.stop()
        other.stop()
