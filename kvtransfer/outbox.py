"""The prefill side's one owner of every KV handoff: the Outbox.

A prefill replica opens an entry per request before the engine runs it; the entry is the
engine's ``KVSink`` (its hooks: layer computed, prefilled, aborted) and every transport server
serves from the Outbox (``KVSource``: ``get`` for a whole pull, ``attach`` for a layer-wise
stream, ``release``). Nothing else decides when a request's KV is freed.

States of one entry (``Handoff``), and who moves it::

    OPEN ──attach (receiver)──> STREAMING
    OPEN, STREAMING ──prefilled (engine)──> HELD          the lease starts
    OPEN, STREAMING ──aborted (engine) / cancel (replica)──> FAILED
    OPEN, STREAMING ──release (receiver gave up)──> RELEASED   the engine frees the blocks at
                                                               its prefilled hook
    HELD ──release (receiver)──> RELEASED                 the blocks are freed now, or at the
                                                          end of the engine's running step
    HELD ──lease passes (expire)──> EXPIRED               likewise
    HELD ──attach (a late receiver)──> HELD               its stream starts from the held KV

Every entry carries a random secret (``Entry.secret``, in the handoff's ``KVRef``): ``get``,
``attach`` and ``release`` of a known request without it, or with another, raise
PermissionDeniedError (compared in constant time, counted in ``stats()["denied"]``) and change
nothing. Knowing a request id is not enough to read a prompt's KV or to free it.

Terminal states (RELEASED, EXPIRED, FAILED) leave the table: a later ``get`` or ``attach`` gets
UnknownRequestError (the transports answer NOT_FOUND), a later ``release`` is a no-op.

Invariants:
- one lock (``_lock``) guards the table and every transition; the clock is injected;
- the engine calls the hooks on its own thread, holding the engine lock, and the hooks take
  ``_lock``: so ``_lock`` is never held while taking the engine lock (``locked``). Blocks are
  read and freed under the engine lock only, after the transition that decided it;
- a pinned KV is freed exactly once: by the transition out of HELD (release, expire, close), or
  by the engine when ``prefilled`` answers False (the entry ended while the prefill ran);
- a receiver's release never waits for the engine's step: the transition is immediate and the
  blocks are freed under the engine lock then, if it is free, or else by the Outbox's freer
  thread once the running step ends. (It waited before: every decode replica's pull then
  waited for the prefill replica's current step, up to a whole batched prompt chunk, before
  its first decode step: measured as 1-2 s stalls after the first token under load.)
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from kvtransfer.base import PermissionDeniedError, check_layout
from kvtransfer.stream import KVStream, StreamBuffer
from services.engine.errors import UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.kv_stream import KVPiece, PinnedKV

log = logging.getLogger(__name__)


class _Freer:
    """Frees pinned KV under the engine lock (``locked``) off the caller's thread: one daemon
    thread, started on first use, frees in submission order."""

    def __init__(self, locked: Callable[[], AbstractContextManager[object]]) -> None:
        self._locked = locked
        self._queue: queue.SimpleQueue[PinnedKV] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def submit(self, pinned: PinnedKV) -> None:
        self._queue.put(pinned)
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-freer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            pinned = self._queue.get()
            try:
                with self._locked():
                    pinned.free()
            except Exception:  # a bug: say so, and keep freeing the others
                log.exception("freeing a released KV hold failed")


class Handoff(enum.Enum):
    OPEN = "open"
    STREAMING = "streaming"
    HELD = "held"
    RELEASED = "released"
    EXPIRED = "expired"
    FAILED = "failed"


TERMINAL = frozenset({Handoff.RELEASED, Handoff.EXPIRED, Handoff.FAILED})
_NEXT: dict[Handoff, frozenset[Handoff]] = {
    Handoff.OPEN: frozenset({Handoff.STREAMING, Handoff.HELD, Handoff.RELEASED, Handoff.FAILED}),
    Handoff.STREAMING: frozenset({Handoff.HELD, Handoff.RELEASED, Handoff.FAILED}),
    Handoff.HELD: frozenset({Handoff.RELEASED, Handoff.EXPIRED}),
}


class IllegalTransitionError(AssertionError):
    """A transition the state diagram does not have: a bug, never a peer's doing."""


@dataclass(frozen=True, slots=True)
class OutboxConfig:
    """lease_s: how long HELD KV waits for its receiver's release; stream_buffer_bytes: bound
    on pieces queued across the open streams (None: unbounded; see ``kvtransfer.stream``)."""

    lease_s: float = 60.0
    stream_buffer_bytes: int | None = None


class Entry:
    """One request's handoff; the engine's ``KVSink`` for it (hooks run on the engine thread,
    under the engine lock, and never wait for a peer)."""

    def __init__(self, outbox: Outbox, request_id: str, stream: KVStream | None) -> None:
        self._outbox = outbox
        self.request_id = request_id
        self.secret = secrets.token_urlsafe(24)  # the transfer's capability (192 bits)
        self.state = Handoff.OPEN
        self.stream = stream  # None: whole pulls only (no layer copies are taken)
        self.pinned: PinnedKV | None = None  # set while HELD
        self.handle: KVHandle | None = None  # the final handle without block data (HELD)
        self.deadline = 0.0  # the lease's end (outbox clock), once HELD

    # ---- the engine's hooks ---------------------------------------------------------------
    @property
    def wants_layers(self) -> bool:
        return self.stream is not None

    def layer_computed(self, piece: KVPiece) -> None:
        if self.stream is not None:
            self.stream.put(piece)

    def prefilled(self, handle: KVHandle, pinned: PinnedKV) -> bool:
        return self._outbox._prefilled(self, handle, pinned)

    def aborted(self, reason: str) -> None:
        self._outbox._fail(self.request_id, reason)


class Outbox:
    """Args:
    fingerprint: the engine's KV layout (what receivers must match).
    locked: the engine lock, as a context manager factory (blocks are read and freed under it);
        one with ``acquire(blocking=False)`` lets a release free at once when it is free
        (a replica hands its engine's ``Turnstile``, so waits end with the step in flight).
    clock: monotonic seconds (injected; tests drive it).
    progressing: whether the engine makes progress (streams send heartbeats only then).
    """

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        locked: Callable[[], AbstractContextManager[object]],
        config: OutboxConfig = OutboxConfig(),
        clock: Callable[[], float] = time.monotonic,
        progressing: Callable[[], bool] | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.config = config
        self._locked = locked
        self._clock = clock
        self._progressing = progressing
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._freer = _Freer(locked)
        self.buffer = (
            None if config.stream_buffer_bytes is None else StreamBuffer(config.stream_buffer_bytes)
        )
        # every handoff's end, by terminal state; receivers that attached early / late
        self.ended = {s.value: 0 for s in TERMINAL}
        self.attached = {"early": 0, "late": 0}
        self.denied = 0  # KV calls refused for a missing or wrong secret

    # ---- the replica's side ---------------------------------------------------------------
    def open(self, request_id: str, num_tokens: int, stream: bool) -> Entry:
        """An entry for a request about to be added to the engine with it as its ``kv_sink``;
        ``stream``: receivers may attach layer-wise (the engine copies out each layer)."""
        s = None
        if stream:
            s = KVStream(
                request_id,
                self.fingerprint,
                num_tokens,
                buffer=self.buffer,
                refill=lambda: self._read(request_id, None),
                progressing=self._progressing,
            )
        entry = Entry(self, request_id, s)
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"a KV handoff for {request_id!r} is already open")
            self._entries[request_id] = entry
        return entry

    def cancel(self, request_id: str, reason: str) -> None:
        """The prefill call ended before the prefill did (an error, the caller went away):
        the receiver learns at once. A no-op once prefilled (the lease or release ends it)."""
        self._fail(request_id, reason)

    def expire(self) -> int:
        """End every HELD entry whose lease passed; returns how many."""
        now = self._clock()
        with self._lock:
            due = [
                e for e in self._entries.values() if e.state is Handoff.HELD and e.deadline <= now
            ]
            for e in due:
                self._end(e, Handoff.EXPIRED)
        for e in due:
            self._free(e, "its lease expired")
        return len(due)

    def close(self) -> None:
        """Free everything (the replica is going away): held KV is released, the rest failed."""
        with self._lock:
            ids = list(self._entries)
        for rid in ids:
            self._release(rid, None)

    # ---- the transports' side (KVSource) --------------------------------------------------
    def get(self, request_id: str, secret: str) -> KVHandle | None:
        try:
            return self._read(request_id, secret)
        except UnknownRequestError:
            return None

    def attach(self, request_id: str, want: LayoutFingerprint, secret: str) -> KVStream:
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.stream is None:
                raise UnknownRequestError(f"no KV stream open for request {request_id!r}")
            self._authorize(e, secret)
            check_layout(self.fingerprint, want)
            early = e.stream.attach()  # raises StreamBusyError for a second receiver
            if early:  # the prefill still runs: the stream is not finished, so OPEN
                self._move(e, Handoff.STREAMING)
            self.attached["early" if early else "late"] += 1
            return e.stream

    def release(self, request_id: str, secret: str) -> None:
        self._release(request_id, secret)

    def _release(self, request_id: str, secret: str | None) -> None:
        """``secret`` None: the replica's own call (closing), not a receiver's: that one frees
        before it returns."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None:
                return  # released, expired or failed already: idempotent
            if secret is not None:
                self._authorize(e, secret)
            self._end(e, Handoff.RELEASED)
        self._free(e, "the receiver released it", wait=secret is None)

    # ---- reading ----------------------------------------------------------------------------
    def state(self, request_id: str) -> Handoff | None:
        """The entry's state; None once it ended (or was never opened)."""
        with self._lock:
            e = self._entries.get(request_id)
            return None if e is None else e.state

    def stats(self) -> dict[str, int]:
        """Entries by live state, ends by terminal state, receivers early / late, spilled
        streams and bytes queued now."""
        with self._lock:
            live = {s.value: 0 for s in Handoff if s not in TERMINAL}
            for e in self._entries.values():
                live[e.state.value] += 1
            out = {**live, **{f"ended_{k}": v for k, v in self.ended.items()}, **self.attached}
            out["denied"] = self.denied
        if self.buffer is not None:
            out |= {"spilled": self.buffer.spilled, "queued_bytes": self.buffer.used}
        return out

    # ---- transitions (under _lock) ----------------------------------------------------------
    def _authorize(self, e: Entry, secret: str) -> None:
        # NOTE: constant time in the secret's content; a refusal changes no state
        if not hmac.compare_digest(e.secret.encode(), (secret or "").encode()):
            self.denied += 1
            raise PermissionDeniedError(f"wrong or missing KV secret for {e.request_id!r}")

    def _move(self, e: Entry, to: Handoff) -> None:
        if to not in _NEXT.get(e.state, frozenset()):
            raise IllegalTransitionError(f"{e.request_id!r}: {e.state.value} -> {to.value}")
        e.state = to

    def _end(self, e: Entry, to: Handoff) -> None:
        self._move(e, to)
        del self._entries[e.request_id]
        self.ended[to.value] += 1

    def _prefilled(self, e: Entry, handle: KVHandle, pinned: PinnedKV) -> bool:
        """The engine's hook (engine thread, engine lock held): keep the blocks (HELD) or,
        when the entry already ended, tell the engine to free them now."""
        with self._lock:
            if self._entries.get(e.request_id) is not e:
                return False
            self._move(e, Handoff.HELD)
            e.pinned, e.handle = pinned, handle
            e.deadline = self._clock() + self.config.lease_s
        if e.stream is not None:
            e.stream.finish(handle)
        return True

    def _fail(self, request_id: str, reason: str) -> None:
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.state is Handoff.HELD:
                return
            self._end(e, Handoff.FAILED)
        if e.stream is not None:
            e.stream.fail(reason)

    # ---- the engine's blocks (under the engine lock, never under _lock) ----------------------
    def _read(self, request_id: str, secret: str | None) -> KVHandle:
        """``secret`` None: the entry's own stream refilling itself (its receiver was
        authorized when it attached)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is not None and secret is not None:
                self._authorize(e, secret)
            if e is None or e.state is not Handoff.HELD:
                raise UnknownRequestError(f"no held KV for request {request_id!r}")
            pinned, handle = e.pinned, e.handle
        assert pinned is not None and handle is not None
        with self._locked():
            blocks: torch.Tensor = pinned.read()  # raises UnknownRequestError once freed
        return dataclasses.replace(handle, blocks=blocks)

    def _free(self, e: Entry, reason: str, wait: bool = True) -> None:
        """``wait`` False: the blocks may be freed after this returns (see the invariants)."""
        pinned, e.pinned = e.pinned, None
        if pinned is not None:
            lock = self._locked()
            acquire = getattr(lock, "acquire", None)  # a real lock, not a null context
            if wait or acquire is None:
                with lock:
                    pinned.free()
            elif acquire(blocking=False):
                try:
                    pinned.free()
                finally:
                    lock.release()  # type: ignore[attr-defined]
            else:
                self._freer.submit(pinned)
        if e.stream is not None:
            e.stream.fail(f"the KV hold ended: {reason}")
