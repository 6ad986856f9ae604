"""The decode side's one owner of every KV handoff: the Inbox.

Given a ``KVRef`` it receives the request's KV (a layer-wise stream when the ref says one is
open, else a whole pull), always releases it at the sender afterwards, and maps every failure to
one ``KVTransferFailedError`` with a reason (counted). The decode replica calls ``receive`` from
a worker thread; nothing else talks to the transport client.

States of one receive, and who moves it::

    RECEIVING ──KV verified──> RECEIVED ──release sent──> (gone)
    RECEIVING ──error / deadline / stall──> FAILED ──release sent──> (gone)

The release is sent on both paths (the sender frees or caches the blocks; its lease covers a
release that is lost), from the same thread, before ``receive`` returns or raises: a caller
that stopped waiting (its request was cancelled) cannot skip it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
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
    """

    def __init__(
        self,
        client: KVClient,
        layout: LayoutFingerprint,
        config: InboxConfig = InboxConfig(),
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.layout = layout
        self.config = config
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._receiving: dict[str, Receive] = {}
        self.failures: dict[str, int] = {}  # by reason
        self.fail_next = 0  # test hook: the next receives fail as a lost transfer would

    def receive(self, ref: KVRef) -> Received:
        """The request's KV, verified; released at the sender either way.

        Raises:
            KVTransferFailedError: with ``reason`` deadline / not_held / layout / transfer.
        """
        with self._lock:
            if ref.request_id in self._receiving:
                raise ValueError(f"{ref.request_id!r} is already being received")
            self._receiving[ref.request_id] = Receive.RECEIVING
        try:
            got = self._take(ref)
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
            self._release(ref)
            with self._lock:
                del self._receiving[ref.request_id]

    def in_flight(self) -> dict[str, str]:
        """Receives under way, by request id (a leak check: empty once idle)."""
        with self._lock:
            return {k: v.value for k, v in self._receiving.items()}

    def _set(self, ref: KVRef, state: Receive) -> None:
        with self._lock:
            self._receiving[ref.request_id] = state

    def _take(self, ref: KVRef) -> Received:
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
