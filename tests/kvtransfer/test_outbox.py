"""The Outbox's state machine (prefill side of the KV handoff), without Ray, servers or sleeps:
the engine's hooks, receivers and the lease drive it; the clock is injected."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
import torch

from kvtransfer.base import PermissionDeniedError, StreamBusyError, StreamFailedError
from kvtransfer.outbox import Handoff, IllegalTransitionError, Outbox, OutboxConfig
from kvtransfer.stream import HEARTBEAT, KVStream
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from tests.kvtransfer.kv_fixtures import iter_pieces, random_handle


class Pinned:
    """What an engine hands the ``prefilled`` hook: its blocks, until freed (once)."""

    def __init__(self, blocks: torch.Tensor, engine_lock: threading.Lock) -> None:
        self.blocks = blocks
        self.frees = 0
        self.lock = engine_lock

    def read(self) -> torch.Tensor:
        assert self.lock.locked(), "blocks are read under the engine lock"
        if self.frees:
            raise UnknownRequestError("freed")
        return self.blocks.clone()

    def free(self) -> None:
        assert self.lock.locked(), "blocks are freed under the engine lock"
        self.frees += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def box():
    lock = threading.Lock()
    clock = Clock()
    outbox = Outbox(
        random_handle().fingerprint,
        lambda: lock,
        OutboxConfig(lease_s=10.0),
        clock,
    )
    return outbox, lock, clock


def _final(h):
    return dataclasses.replace(h, blocks=torch.empty(0))


def _prefill(outbox, lock, entry, h, stream_pieces=True) -> Pinned:
    """What the engine does for a request: layers as computed, then the prefilled hook."""
    pinned = Pinned(h.blocks, lock)
    with lock:  # NOTE: the engine calls its hooks holding its own lock
        if stream_pieces and entry.wants_layers:
            for piece in iter_pieces(h):
                entry.layer_computed(piece)
        keep = entry.prefilled(_final(h), pinned)
        if not keep:
            pinned.free()
    return pinned


def _drain(stream: KVStream):
    return [e for e in stream.events(deadline=float("inf"), heartbeat_s=3600) if e is not HEARTBEAT]


def test_pull_then_release_frees_once(box):
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=False)
    assert outbox.state("r") is Handoff.OPEN and not entry.wants_layers
    assert outbox.get("r", entry.secret) is None  # not prefilled yet: nothing to pull
    pinned = _prefill(outbox, lock, entry, h)
    assert outbox.state("r") is Handoff.HELD
    got = outbox.get("r", entry.secret)
    assert got is not None and torch.equal(got.blocks, h.blocks)
    assert got.token_ids == h.token_ids and got.first_logprob == h.first_logprob
    outbox.release("r", entry.secret)
    outbox.release("r", entry.secret)  # idempotent
    assert pinned.frees == 1
    assert outbox.state("r") is None and outbox.get("r", entry.secret) is None
    assert outbox.stats()["ended_released"] == 1 and outbox.stats()["held"] == 0


def test_a_release_during_an_engine_step_returns_at_once_and_frees_after_the_step(box):
    """The receiver's release must not wait for the prefill engine's running step (it held
    every decode replica's first decode step behind a whole prompt chunk); the blocks are
    freed, once, under the engine lock as soon as the step lets go of it."""
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=False)
    pinned = _prefill(outbox, lock, entry, h)
    freed = threading.Event()
    free = pinned.free
    pinned.free = lambda: (free(), freed.set())  # type: ignore[method-assign]
    with lock:  # an engine step is running
        receiver = threading.Thread(target=outbox.release, args=("r", entry.secret))
        receiver.start()
        receiver.join(timeout=10)
        assert not receiver.is_alive()  # returned although the lock is held
        assert outbox.state("r") is None and outbox.stats()["ended_released"] == 1
        assert pinned.frees == 0
    assert freed.wait(timeout=10)
    assert pinned.frees == 1


def test_early_receiver_streams_then_holds(box):
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    stream = outbox.attach("r", h.fingerprint, entry.secret)
    assert outbox.state("r") is Handoff.STREAMING
    with pytest.raises(StreamBusyError):
        outbox.attach("r", h.fingerprint, entry.secret)
    pinned = _prefill(outbox, lock, entry, h)
    events = _drain(stream)
    assert len(events) == len(list(iter_pieces(h))) + 1 and events[-1].request_id == "r"
    assert outbox.state("r") is Handoff.HELD  # still held until the receiver releases
    outbox.release("r", entry.secret)
    assert pinned.frees == 1
    assert outbox.stats()["early"] == 1


def test_late_receiver_attaches_to_held(box):
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    _prefill(outbox, lock, entry, h)
    stream = outbox.attach("r", h.fingerprint, entry.secret)
    assert outbox.state("r") is Handoff.HELD
    assert _drain(stream)[-1].num_computed == h.num_computed
    assert outbox.stats()["late"] == 1


def test_attach_errors(box):
    outbox, _, _ = box
    h = random_handle()
    outbox.open("whole", h.num_computed, stream=False)
    with pytest.raises(UnknownRequestError):
        outbox.attach("whole", h.fingerprint, "")  # opened for whole pulls only
    with pytest.raises(UnknownRequestError):
        outbox.attach("nobody", h.fingerprint, "")
    entry = outbox.open("r", h.num_computed, stream=True)
    with pytest.raises(LayoutMismatchError, match="head_dim"):
        outbox.attach("r", dataclasses.replace(h.fingerprint, head_dim=16), entry.secret)
    assert outbox.state("r") is Handoff.OPEN  # a refused receiver changes nothing
    with pytest.raises(ValueError, match="already open"):
        outbox.open("r", h.num_computed, stream=True)


def test_lease_expires_held_kv(box):
    outbox, lock, clock = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=False)
    pinned = _prefill(outbox, lock, entry, h)
    clock.now = 109.9
    assert outbox.expire() == 0 and outbox.state("r") is Handoff.HELD
    clock.now = 110.0
    assert outbox.expire() == 1
    assert pinned.frees == 1 and outbox.state("r") is None and outbox.get("r", entry.secret) is None
    assert outbox.stats()["ended_expired"] == 1
    outbox.release("r", entry.secret)  # a release after the lease is a no-op
    assert pinned.frees == 1


def test_expiry_fails_an_unread_stream(box):
    outbox, lock, clock = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    stream = outbox.attach("r", h.fingerprint, entry.secret)
    _prefill(outbox, lock, entry, h, stream_pieces=False)
    clock.now += 11
    outbox.expire()
    with pytest.raises(StreamFailedError, match="lease expired"):
        _drain(stream)


def test_release_while_prefilling_frees_at_the_prefilled_hook(box):
    """A streaming receiver that gives up mid-prefill: the entry ends at once, the receiver's
    stream fails, and the engine frees the blocks when the prefill ends (hook answers False)."""
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    stream = outbox.attach("r", h.fingerprint, entry.secret)
    outbox.release("r", entry.secret)
    assert outbox.state("r") is None
    pinned = _prefill(outbox, lock, entry, h)
    assert pinned.frees == 1  # freed by the engine, not held
    with pytest.raises(StreamFailedError):
        _drain(stream)
    assert outbox.stats()["ended_released"] == 1 and outbox.stats()["held"] == 0


@pytest.mark.parametrize("how", ["aborted", "cancel"])
def test_failure_before_prefilled_reaches_the_receiver(box, how):
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    stream = outbox.attach("r", h.fingerprint, entry.secret)
    with lock:
        entry.layer_computed(next(iter_pieces(h)))
    if how == "aborted":
        with lock:
            entry.aborted("the request was aborted")
    else:
        outbox.cancel("r", "the prefill call ended early")
    with pytest.raises(StreamFailedError):
        _drain(stream)
    assert outbox.state("r") is None and outbox.stats()["ended_failed"] == 1
    # a late prefilled hook (it cannot come after an abort, but must be harmless) frees
    assert _prefill(outbox, lock, entry, h, stream_pieces=False).frees == 1


def test_cancel_after_prefilled_keeps_the_hold(box):
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    _prefill(outbox, lock, entry, h)
    outbox.cancel("r", "the prefill call returned")
    assert outbox.state("r") is Handoff.HELD  # the lease or the release ends it


def test_read_after_free_is_unknown_not_stale(box):
    """A pull that looked the entry up just before a release freed it must not read reused
    blocks: the pinned KV refuses once freed."""
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=False)
    pinned = _prefill(outbox, lock, entry, h)
    with lock:
        pinned.free()
    assert outbox.get("r", entry.secret) is None


def test_illegal_transitions_raise(box):
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=False)
    _prefill(outbox, lock, entry, h)
    with pytest.raises(IllegalTransitionError), lock:
        outbox._move(entry, Handoff.STREAMING)


def test_close_frees_everything(box):
    outbox, lock, _ = box
    h = random_handle()
    held = _prefill(outbox, lock, outbox.open("a", h.num_computed, stream=False), h)
    outbox.open("b", h.num_computed, stream=True)
    outbox.close()
    assert held.frees == 1
    stats = outbox.stats()
    assert stats["open"] == stats["held"] == stats["streaming"] == 0


def test_random_lifecycles_leave_nothing(box):
    """A thousand handoffs, each ended by a random mix of receivers, releases, cancels, aborts
    and leases, in random orders: every pinned KV is freed exactly once and the table is empty."""
    import random

    outbox, lock, clock = box
    rng = random.Random(7)
    h = random_handle(n_blocks=2)
    pins: list[Pinned] = []
    for i in range(1000):
        rid = f"r{i}"
        entry = outbox.open(rid, h.num_computed, stream=rng.random() < 0.7)
        if entry.wants_layers and rng.random() < 0.5:
            outbox.attach(rid, h.fingerprint, entry.secret)
        fate = rng.choice(["release_early", "abort", "cancel", "prefill"])
        if fate == "release_early":
            outbox.release(rid, entry.secret)
        elif fate == "abort":
            with lock:
                entry.aborted("aborted")
            continue
        elif fate == "cancel":
            outbox.cancel(rid, "cancelled")
            continue
        pins.append(_prefill(outbox, lock, entry, h, stream_pieces=False))
        end = rng.choice(["release", "expire", "pull"])
        if end == "pull":
            assert outbox.get(rid, entry.secret) is not None or fate == "release_early"
            outbox.release(rid, entry.secret)
        elif end == "release":
            outbox.release(rid, entry.secret)
    clock.now += 11
    outbox.expire()
    assert all(p.frees == 1 for p in pins)
    stats = outbox.stats()
    assert stats["open"] == stats["streaming"] == stats["held"] == 0
    assert sum(v for k, v in stats.items() if k.startswith("ended_")) == 1000
    assert outbox.buffer is None or outbox.buffer.used == 0


def test_bounded_streams_give_their_bytes_back():
    lock = threading.Lock()
    h = random_handle()
    outbox = Outbox(
        h.fingerprint, lambda: lock, OutboxConfig(lease_s=5.0, stream_buffer_bytes=1 << 20)
    )
    entries = [outbox.open(f"r{i}", h.num_computed, stream=True) for i in range(3)]
    streams = [outbox.attach(f"r{i}", h.fingerprint, entries[i].secret) for i in range(2)]
    for e in entries:
        with lock:
            for piece in iter_pieces(h):
                e.layer_computed(piece)
    assert outbox.buffer is not None and outbox.buffer.used > 0
    _prefill(outbox, lock, entries[0], h, stream_pieces=False)
    _drain(streams[0])
    outbox.release("r0", entries[0].secret)
    outbox.release("r1", entries[1].secret)  # mid-prefill: its queued pieces are dropped
    with lock:
        entries[2].aborted("aborted")  # never attached
    with contextlib.suppress(StreamFailedError):
        _drain(streams[1])
    assert outbox.buffer.used == 0


@pytest.mark.parametrize("call", ["get", "attach", "release"])
@pytest.mark.parametrize("secret", ["", "wrong", "x" * 32])
def test_a_known_request_without_its_secret_is_denied_and_nothing_changes(box, call, secret):
    """A request id is not a capability: a missing or wrong secret is refused (and counted)
    on every call, before any state changes; each entry's secret is its own."""
    outbox, lock, _ = box
    h = random_handle()
    entry = outbox.open("r", h.num_computed, stream=True)
    other = outbox.open("other", h.num_computed, stream=True)
    assert entry.secret != other.secret and len(entry.secret) >= 32
    pinned = _prefill(outbox, lock, entry, h, stream_pieces=False)
    for wrong in (secret, other.secret):
        with pytest.raises(PermissionDeniedError):
            if call == "get":
                outbox.get("r", wrong)
            elif call == "attach":
                outbox.attach("r", h.fingerprint, wrong)
            else:
                outbox.release("r", wrong)
    assert outbox.stats()["denied"] == 2
    assert outbox.state("r") is Handoff.HELD and pinned.frees == 0  # untouched
    assert outbox.get("r", entry.secret) is not None  # the holder still gets it
    outbox.release("r", entry.secret)
    assert pinned.frees == 1
    outbox.release("r", "wrong")  # gone: nothing to protect, idempotent as before


def test_the_secret_is_not_in_a_ref_s_repr():
    from kvtransfer.base import KVRef

    ref = KVRef("r", "h:1", True, "s3cr3t-value")
    assert "s3cr3t" not in repr(ref) and ref.secret == "s3cr3t-value"
