"""In-process prefix index (one process: the embedded default, and the reference backend)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from services.engine.block_hash import BlockHash


class MemoryIndex:
    def __init__(self) -> None:
        self._blocks: dict[BlockHash, set[str]] = {}
        self._by_replica: dict[str, set[BlockHash]] = {}
        self._leases: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            mine = self._by_replica.setdefault(replica, set())
            for h in hashes:
                self._blocks.setdefault(h, set()).add(replica)
                mine.add(h)

    def evict(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._remove(replica, hashes)

    def drop_replica(self, replica: str) -> None:
        with self._lock:
            self._remove(replica, list(self._by_replica.get(replica, ())))
            self._by_replica.pop(replica, None)
            self._leases.pop(replica, None)

    def heartbeat(self, replica: str, ttl_s: float) -> bool:
        now = time.monotonic()
        with self._lock:
            held = self._leases.get(replica, 0.0) > now
            self._leases[replica] = now + ttl_s
            return held

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            for r in [r for r, t in self._leases.items() if t <= now]:  # expired: clean up
                self._remove(r, list(self._by_replica.get(r, ())))
                self._by_replica.pop(r, None)
                del self._leases[r]
            out: dict[str, int] = {}
            alive: set[str] | None = None
            for i, h in enumerate(hashes):
                holders = {r for r in self._blocks.get(h, ()) if r in self._leases}
                alive = holders if alive is None else alive & holders
                if not alive:
                    break
                for r in alive:
                    out[r] = i + 1
            return out

    def _remove(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        mine = self._by_replica.get(replica, set())
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._blocks[h]
            mine.discard(h)
