"""Prefix index: which replica holds which KV blocks (by block hash), for prefix-aware routing.

Interface (``PrefixIndex``), two backends behind a registry: ``memory`` (in-process, the
embedded default when no Redis URL is configured) and ``redis``. Every backend passes the same
contract suite (tests/prefix_index/).

Contract:
- ``add`` / ``evict`` record and remove a replica's blocks; ``drop_replica`` removes all of them.
- ``heartbeat(replica, ttl_s)`` holds a lease and says whether it was still held; a replica whose lease has expired is invisible to
  ``lookup`` (and its entries are cleaned up), so a dead replica's entries go away on their own.
- replica ids are unique per replica *start* (a per-process nonce), so entries a dead replica
  left behind can never be mistaken for a restarted one's; they stay invisible and are cleaned
  up as lookups pass them.
- ``lookup(hashes)`` returns, per live replica, how many leading blocks of ``hashes`` it holds,
  stopping at the first block no live replica holds; one round trip for Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from services.engine.block_hash import BlockHash


class PrefixIndex(Protocol):
    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None: ...

    def evict(self, replica: str, hashes: Sequence[BlockHash]) -> None: ...

    def drop_replica(self, replica: str) -> None: ...

    def heartbeat(self, replica: str, ttl_s: float) -> bool:
        """Hold (or renew) the lease; False when the lease had lapsed or never existed, i.e.
        the index may have lost this replica's entries (expiry, a restarted index)."""
        ...

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica -> number of leading blocks of ``hashes`` it holds (live replicas only)."""
        ...


def _memory(url: str | None, namespace: str) -> PrefixIndex:
    from services.prefix_index.memory import MemoryIndex

    return MemoryIndex()


def _redis(url: str | None, namespace: str) -> PrefixIndex:
    from services.prefix_index.redis_index import RedisIndex

    if not url:
        raise ValueError("the redis prefix index needs a URL (redis://, rediss:// for TLS)")
    return RedisIndex(url, namespace)


INDEX_BACKENDS: dict[str, Callable[[str | None, str], PrefixIndex]] = {
    "memory": _memory,
    "redis": _redis,
}


def get_index(name: str, url: str | None = None, namespace: str = "pdserve") -> PrefixIndex:
    """Instantiate a backend by name; the error lists the valid names."""
    try:
        factory = INDEX_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown prefix index backend {name!r}; choose one of: {', '.join(INDEX_BACKENDS)}"
        ) from None
    return factory(url, namespace)
