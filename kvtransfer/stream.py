"""A layer-wise KV stream between a prefill engine (the producer) and one transport receiver.

The engine puts pieces from its loop thread under its lock (``KVSink``: never waits); a
transport server thread takes them out (``events``) and sends them. Pieces are dropped once
taken, so a stream holds what its receiver has not read yet (at most one copy of the request's
KV, when the receiver attaches late).

Host memory across a replica's streams is bounded (``StreamBuffer``, ``kv_stream_buffer_mb``):
a piece that would pass the bound *spills* its stream instead of waiting (the engine never
waits for a peer): the stream drops what it has queued, takes no more pieces, and at the end
sends every layer from the request's held KV (``refill``), as a whole pull would. Pieces
already sent stay valid: a receiver applies pieces in order, a later one over an earlier one.

Progress: while a sender waits for pieces it sends a heartbeat every ``HEARTBEAT_S``, as long
as its engine is making progress (``progressing``: a queued prefill is not a stalled one). A
receiver that hears nothing for its stall timeout (``kv_stream_stall_s``) gives up: the
sender hangs, its engine stalls, or the network dropped the stream without closing it.

Lifecycle: a stream belongs to one entry of the prefill replica's ``kvtransfer.outbox.Outbox``
(opened before the replica names its KV address), which attaches its one receiver, finishes it
(the final handle is queued after the last piece) and fails it when the handoff ends (aborted,
finished at the first token, released, lease expired): a stream nobody came for does not
outlive the request's KV lease.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from kvtransfer.base import StreamBusyError, StreamFailedError
from services.engine.errors import UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.kv_stream import KVPiece

HEARTBEAT_S = 2.0  # a receiver's stall timeout must be several of these (config: >= 10 s)


class Heartbeat:
    """What ``KVStream.events`` yields while waiting: the sender and its engine are alive."""


HEARTBEAT = Heartbeat()


class StreamBuffer:
    """Bytes of layer pieces queued in a replica's streams, under ``cap_bytes`` (see the
    module's note on spilling). Thread-safe; never blocks."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.used = 0
        self.spilled = 0  # streams that passed the bound
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.cap_bytes:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
            assert self.used >= 0, "gave back more than was taken"

    def spill(self, n: int) -> None:
        """A stream spilled, giving back the ``n`` bytes it had queued."""
        with self._lock:
            self.used -= n
            self.spilled += 1


def piece_bytes(piece: KVPiece) -> int:
    return piece.data.numel() * piece.data.element_size()


def layer_pieces(handle: KVHandle) -> Iterator[KVPiece]:
    """Every layer of a handle with block data, as whole-prompt pieces (views)."""
    n = handle.num_computed
    for layer in range(handle.fingerprint.num_layers):
        # [2, blocks, block_size, heads, row] -> [2, positions, heads, row]
        yield KVPiece(layer, 0, n, handle.blocks[layer].flatten(1, 2)[:, :n])


class KVStream:
    """Args:
    num_tokens: positions whose KV the stream will carry (the prompt length).
    buffer: the replica's bound on queued pieces; None = unbounded.
    refill: the request's held KV with block data, once the prefill is done (what a spilled
        stream sends at its end); raises ``UnknownRequestError`` once the hold has ended.
    progressing: whether the engine makes progress (heartbeats are sent only then); None =
        always.
    """

    def __init__(
        self,
        request_id: str,
        fingerprint: LayoutFingerprint,
        num_tokens: int,
        buffer: StreamBuffer | None = None,
        refill: Callable[[], KVHandle] | None = None,
        progressing: Callable[[], bool] | None = None,
    ) -> None:
        assert buffer is None or refill is not None, "a bounded stream must be able to refill"
        self.request_id = request_id
        self.fingerprint = fingerprint
        self.num_tokens = num_tokens
        self.finished_unix = 0.0  # when the final handle came (time.time)
        self._cond = threading.Condition()
        self._items: deque[KVPiece | KVHandle] = deque()
        self._finished = False
        self._failed: str | None = None
        self._attached = False
        self._buffer = buffer
        self._refill = refill
        self._progressing = progressing or (lambda: True)
        self._queued_bytes = 0  # of the pieces in _items (taken from the buffer)
        self._spilled = False

    @property
    def spilled(self) -> bool:
        with self._cond:
            return self._spilled

    @property
    def finished(self) -> bool:
        """The final handle was queued (the prefill is done)."""
        with self._cond:
            return self._finished

    # ---- the engine's side (KVSink) ------------------------------------------------------
    def put(self, piece: KVPiece) -> None:
        with self._cond:
            if self._failed is not None or self._finished or self._spilled:
                return
            n = piece_bytes(piece)
            if self._buffer is not None and not self._buffer.take(n):
                # over the replica's bound: drop what is queued, refill at the end
                self._spilled = True
                self._buffer.spill(self._queued_bytes)
                self._queued_bytes = 0
                self._items.clear()
                return
            self._queued_bytes += n
            self._items.append(piece)
            self._cond.notify_all()

    def finish(self, handle: KVHandle) -> None:
        with self._cond:
            if self._failed is None and not self._finished:
                self._finished = True
                self.finished_unix = time.time()
                self._items.append(handle)
                self._cond.notify_all()

    def fail(self, reason: str) -> None:
        with self._cond:
            if self._failed is not None:
                return
            self._failed = reason
            self._items.clear()
            if self._buffer is not None:
                self._buffer.give(self._queued_bytes)
            self._queued_bytes = 0
            self._cond.notify_all()

    # ---- the receiver's side --------------------------------------------------------------
    def attach(self) -> bool:
        """Become the stream's receiver; True if the prefill was still running (the transfer
        overlaps it), False if it had finished."""
        with self._cond:
            if self._attached:
                raise StreamBusyError(f"the KV stream of {self.request_id!r} has a receiver")
            self._attached = True
            return not self._finished

    def events(
        self,
        deadline: float,
        alive: Callable[[], bool] = lambda: True,
        heartbeat_s: float | None = None,
    ) -> Iterator[KVPiece | KVHandle | Heartbeat]:
        """Pieces in order, then the final handle; ``HEARTBEAT`` after every ``heartbeat_s``
        spent waiting while the engine makes progress. ``deadline`` is ``time.monotonic()``;
        ``alive`` is polled while waiting (False: the receiver went away, stop quietly).

        Raises:
            StreamFailedError: the stream closed before the final handle.
            TimeoutError: the deadline passed first.
        """
        heartbeat_s = heartbeat_s or HEARTBEAT_S
        last = time.monotonic()  # of the last thing yielded
        while True:
            beat = False
            with self._cond:
                while not self._items and self._failed is None:
                    now = time.monotonic()
                    left = deadline - now
                    if left <= 0:
                        raise TimeoutError(f"the KV stream of {self.request_id!r} timed out")
                    if not alive():
                        return
                    if now - last >= heartbeat_s:
                        beat = True
                        break
                    self._cond.wait(min(left, 0.25, heartbeat_s - (now - last)))
            if beat:
                last = time.monotonic()
                if self._progressing():  # NOTE: outside the lock: it may read engine state
                    yield HEARTBEAT
                continue
            with self._cond:
                if not self._items:
                    raise StreamFailedError(str(self._failed))
                item = self._items.popleft()
                spilled = self._spilled
                n = 0 if isinstance(item, KVHandle) else piece_bytes(item)
                self._queued_bytes -= n  # in flight now: still taken from the buffer
            if isinstance(item, KVHandle):
                if spilled:
                    yield from layer_pieces(self._held_kv())
                yield item
                return
            try:
                yield item
            finally:  # sent (or the receiver went away): its bytes leave the bound
                if self._buffer is not None:
                    self._buffer.give(n)
            last = time.monotonic()

    def _held_kv(self) -> KVHandle:
        assert self._refill is not None
        try:
            return self._refill()
        except UnknownRequestError:  # the hold ended between the last piece and now
            raise StreamFailedError(f"the KV of {self.request_id!r} is no longer held") from None
