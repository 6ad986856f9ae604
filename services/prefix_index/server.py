"""The in-process index as a Ray Serve deployment, and a ``PrefixIndex`` over its handle.

Without a Redis URL the cluster's index is one ``MemoryIndex`` living in a small deployment
(``prefix_index``) of the same application: replicas publish to it and the gateway looks up
in it through Serve handles. It is the embedded default; state is lost when that replica
restarts, and publishers then republish (their heartbeat finds the lease gone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.engine.block_hash import BlockHash
from services.prefix_index.memory import MemoryIndex


class IndexServer:
    """The deployment's class: every method of ``PrefixIndex`` over one ``MemoryIndex``."""

    def __init__(self) -> None:
        self._index = MemoryIndex()

    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._index.add(replica, hashes)

    def evict(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._index.evict(replica, hashes)

    def drop_replica(self, replica: str) -> None:
        self._index.drop_replica(replica)

    def heartbeat(self, replica: str, ttl_s: float) -> bool:
        return self._index.heartbeat(replica, ttl_s)

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._index.lookup(hashes)


class HandleIndex:
    """``PrefixIndex`` over a Serve handle to ``IndexServer``; blocking, so call it from a
    thread other than an event loop's (the publisher's thread, ``asyncio.to_thread``)."""

    def __init__(self, handle: Any, timeout_s: float = 2.0) -> None:
        self._h = handle
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        return getattr(self._h, method).remote(*args).result(timeout_s=self.timeout_s)

    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._call("add", replica, list(hashes))

    def evict(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self._call("evict", replica, list(hashes))

    def drop_replica(self, replica: str) -> None:
        self._call("drop_replica", replica)

    def heartbeat(self, replica: str, ttl_s: float) -> bool:
        return bool(self._call("heartbeat", replica, ttl_s))

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return dict(self._call("lookup", list(hashes)))
