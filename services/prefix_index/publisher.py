"""Publishes one replica's prefix-cache events to the index, off the engine's hot path.

Invariants: the engine thread only appends to a deque (never waits on Redis); a background
thread batches the events (one call per ``batch_s`` at most: a replica caches blocks all the
time, a decode batch's rows each crossing a block every ``block_size`` steps, and a call per
event kept the index's process and the replica's own GIL busy; a ``flush`` or ``stop`` ends
that wait), refreshes the replica's lease every ``ttl_s / 3``, and after any index error, a
lapsed lease or an index that lost its data (restarted) resynchronizes the replica's whole
entry set from a snapshot (so a Redis outage leaves no stale or missing entries once Redis is
back). Errors are logged and counted.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from services.engine.block_hash import BlockHash
from services.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


def unique_replica_id(name: str) -> str:
    """A replica id unique to this start (see the index contract)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


class IndexPublisher:
    def __init__(
        self,
        index: PrefixIndex,
        replica_id: str,
        snapshot: Callable[[], list[BlockHash]],
        ttl_s: float = 10.0,
        batch_s: float = 0.1,
    ) -> None:
        self.index = index
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.batch_s = batch_s
        self.errors = 0
        self._snapshot = snapshot
        self._seq = itertools.count(1)  # next() is atomic: safe from the engine thread
        self._events: deque[tuple[int, bool, BlockHash]] = deque()  # (seq, added?, hash)
        self._published = 0  # highest seq written to the index
        self._wake = threading.Event()
        self._flush = threading.Event()  # a flush (or stop) waits: publish without batching
        self._stop = threading.Event()
        self._down = False  # in an outage (logged once per outage)
        self._needs_resync = True  # a new replica starts clean: drop, then publish what it has
        self._thread = threading.Thread(target=self._run, name="index-publisher", daemon=True)
        self._thread.start()

    # called from the engine thread (under its lock): O(1), never blocks
    def on_cached(self, h: BlockHash) -> None:
        self._events.append((next(self._seq), True, h))
        self._wake.set()

    def on_evicted(self, h: BlockHash) -> None:
        self._events.append((next(self._seq), False, h))
        self._wake.set()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event queued so far is in the index; False on timeout."""
        target = self._events[-1][0] if self._events else 0
        end = time.monotonic() + timeout_s
        self._flush.set()
        self._wake.set()
        while (self._published < target or self._needs_resync) and time.monotonic() < end:
            time.sleep(0.01)
        return self._published >= target and not self._needs_resync

    def stop(self) -> None:
        self._stop.set()
        self._flush.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.index.drop_replica(self.replica_id)
        except Exception as e:  # the lease expires anyway
            log.warning("prefix index: dropping %s failed: %s", self.replica_id, e)

    def _run(self) -> None:
        beat_at = 0.0  # when the lease is due for its refresh
        while not self._stop.is_set():
            try:
                if time.monotonic() >= beat_at:
                    beat_at = time.monotonic() + self.ttl_s / 3
                    if not self.index.heartbeat(self.replica_id, self.ttl_s):
                        self._needs_resync = True  # lapsed lease or a restarted index
                if self._needs_resync:
                    self._resync()
                self._drain()
                if self._down:
                    log.warning("prefix index is back; %s republished its cache", self.replica_id)
                    self._down = False
            except Exception as e:  # Redis down etc.: count, log once, resync when it is back
                self.errors += 1
                self._needs_resync = True
                if not self._down:
                    log.warning(
                        "prefix index unavailable (%s); this replica's hits are not routed", e
                    )
                self._down = True
            self._wake.wait(timeout=max(0.0, beat_at - time.monotonic()))
            self._wake.clear()
            # let the burst this wake began gather; a flush or stop cuts it short (a flush
            # that lands after the wait is still served: the drain comes right after)
            self._flush.wait(self.batch_s)
            self._flush.clear()

    def _resync(self) -> None:
        # NOTE: the snapshot is taken after clearing, so events after it are replayed on top
        last = self._events[-1][0] if self._events else self._published
        self._events.clear()
        hashes = self._snapshot()
        self.index.drop_replica(self.replica_id)
        self.index.heartbeat(self.replica_id, self.ttl_s)
        self.index.add(self.replica_id, hashes)
        self._published = max(self._published, last)
        self._needs_resync = False

    def _drain(self) -> None:
        final: dict[BlockHash, bool] = {}  # the last event per hash wins
        last = 0
        while self._events:
            seq, added, h = self._events.popleft()
            final[h] = added
            last = seq
        evicts = [h for h, added in final.items() if not added]
        adds = [h for h, added in final.items() if added]
        if evicts:
            self.index.evict(self.replica_id, evicts)
        if adds:
            self.index.add(self.replica_id, adds)
        self._published = max(self._published, last)
