"""The decode side's one owner of every KV handoff: the Inbox.

Given a ``KVRef`` it receives the request's KV (a layer-wise stream when the ref says one is
open, else a whole pull), always releases it at the sender afterwards, and maps every failure to
one ``KVTransferFailedError`` with a reason (counted). The decode replica calls ``receive`` from
a worker thread; nothing else talks to the transport client.

States of one receive, and who moves it::

    RECEIVING ──KV verified──> RECEIVED ──release handed over──> RELEASING ──sent──> (gone)
    RECEIVING ──error / deadline / stall──> FAILED ──release handed over──> RELEASING ──> (gone)

The release is sent on both paths (the sender frees or caches the blocks; its lease covers a
release that is lost). ``receive`` hands it to the Inbox's release threads before it returns or
raises, so a caller that stopped waiting (its request was cancelled) cannot skip it, but it
does not wait for the round trip: the sender is a prefill replica whose core is busy with its
next chunk, and its answer took 10.7 ms at the median, 21 ms at worst (the default ``pdserve
serve`` under the standard load), every one of them added to the request's first decode gap.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtransfer.base import (
    KVClient,
    KVRef,
    KVTransferFailedError,
    PermissionDeniedError,
    TransferError,
)
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint

log = logging.getLogger(__name__)


class Receive(enum.Enum):
    RECEIVING = "receiving"
    RECEIVED = "received"
    FAILED = "failed"
    RELEASING = "releasing"  # the receive has returned; its release is on its way


def failure_reason(e: Exception) -> str:
    if isinstance(e, TimeoutError):
        return "deadline"
    if isinstance(e, UnknownRequestError):
        return "not_held"  # expired on the prefill side, or never held there
    if isinstance(e, LayoutMismatchError):
        return "layout"
    if isinstance(e, PermissionDeniedError):
        return "denied"  # the sender refused the ref's secret
    return "transfer"  # corrupt, incomplete, a dead peer, a failed prefill


@dataclass(frozen=True, slots=True)
class InboxConfig:
    """pull_timeout_s: a whole pull's deadline; stream_timeout_s: a layer-wise receive's (it
    spans the prefill itself); stall_s: a stream that sends nothing, not even a heartbeat,
    for this long is given up; release_timeout_s: the release call's deadline."""

    pull_timeout_s: float = 30.0
    stream_timeout_s: float = 600.0
    stall_s: float | None = 30.0
    release_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Received:
    handle: KVHandle
    exposed_s: float  # transfer time the TTFT could not hide
    nbytes: int


class Inbox:
    """Args:
    client: the transport's client (one per replica).
    layout: this engine's KV layout (the sender must match it).
    clock / wall: monotonic and Unix seconds (injected; a stream's exposed time is measured
        against the sender's Unix finish time).
    release_in: runs a release off the receiving thread (None: the Inbox's own release
        threads; a test passes a synchronous runner).
    """

    def __init__(
        self,
        client: KVClient,
        layout: LayoutFingerprint,
        config: InboxConfig = InboxConfig(),
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
        release_in: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.client = client
        self.layout = layout
        self.config = config
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._receiving: dict[str, Receive] = {}
        # NOTE: a few threads: a dead sender holds each of its releases for release_timeout_s
        self._release_pool = (
            ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-release")
            if release_in is None
            else None
        )
        self._release_in = release_in or self._release_pool.submit  # type: ignore[union-attr]
        self._releasing: dict[str, int] = {}  # request id -> releases handed over, not yet sent
        self.failures: dict[str, int] = {}  # by reason
        self.fail_next = 0  # test hook: the next receives fail as a lost transfer would

    def receive(self, ref: KVRef, on_layers: Callable[[], None] | None = None) -> Received:
        """The request's KV, verified; released at the sender either way. ``on_layers``: a
        layer-wise receive calls it once every layer is in, before the trailer.

        Raises:
            KVTransferFailedError: with ``reason`` deadline / not_held / layout / transfer.
        """
        with self._lock:
            if ref.request_id in self._receiving:
                raise ValueError(f"{ref.request_id!r} is already being received")
            self._receiving[ref.request_id] = Receive.RECEIVING
        try:
            got = self._take(ref, on_layers)
            self._set(ref, Receive.RECEIVED)
            return got
        except (
            TransferError,
            TimeoutError,
            UnknownRequestError,
            LayoutMismatchError,
            PermissionDeniedError,
        ) as e:
            self._set(ref, Receive.FAILED)
            reason = failure_reason(e)
            with self._lock:
                self.failures[reason] = self.failures.get(reason, 0) + 1
            raise KVTransferFailedError(
                f"KV transfer for {ref.request_id!r} failed: {e}", reason
            ) from None
        finally:
            with self._lock:
                del self._receiving[ref.request_id]
                self._releasing[ref.request_id] = self._releasing.get(ref.request_id, 0) + 1
            try:
                self._release_in(lambda: self._release(ref))
            except RuntimeError:  # closed (the replica is going away): send it from here
                self._release(ref)

    def in_flight(self) -> dict[str, str]:
        """Receives under way and releases not yet sent, by request id (a leak check: empty
        once idle)."""
        with self._lock:
            out = dict.fromkeys(self._releasing, Receive.RELEASING.value)
            out.update((k, v.value) for k, v in self._receiving.items())
            return out

    def close(self) -> None:
        """Stops taking releases; those handed over are still sent (the pool's threads)."""
        if self._release_pool is not None:
            self._release_pool.shutdown(wait=False)

    def _set(self, ref: KVRef, state: Receive) -> None:
        with self._lock:
            self._receiving[ref.request_id] = state

    def _take(self, ref: KVRef, on_layers: Callable[[], None] | None) -> Received:
        with self._lock:
            if self.fail_next > 0:
                self.fail_next -= 1
                raise TransferError("injected transfer failure (test hook)")
        c = self.config
        start = self._clock()
        if ref.layerwise:
            handle, finished_unix = self.client.pull_stream(
                ref.address,
                ref.request_id,
                self.layout,
                c.stream_timeout_s,
                c.stall_s,
                secret=ref.secret,
                on_layers=on_layers,
            )
            # NOTE: wall clocks of two hosts; clamped, since only the excess is exposed
            exposed = max(0.0, self._wall() - finished_unix)
        else:
            handle = self.client.pull(
                ref.address, ref.request_id, self.layout, c.pull_timeout_s, secret=ref.secret
            )
            exposed = self._clock() - start
        return Received(handle, exposed, handle.nbytes)

    def _release(self, ref: KVRef) -> None:
        try:
            self.client.release(
                ref.address, ref.request_id, self.config.release_timeout_s, secret=ref.secret
            )
        except Exception as e:  # the sender's lease frees the blocks anyway
            log.warning("KV release for %s at %s failed: %s", ref.request_id, ref.address, e)
        finally:
            with self._lock:
                left = self._releasing.pop(ref.request_id) - 1
                if left:
                    self._releasing[ref.request_id] = left
