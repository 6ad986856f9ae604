"""The request routers of this process by pool, so the gateway's ``/metrics`` can read every
replica's latest ``record_routing_stats`` report at scrape time.

NOTE: its own module: Ray Serve pickles the router class by value, and a lock among the
globals its methods reference cannot be pickled; a module is pickled by reference.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

# pool name -> the routers of this process routing to it (one per handle, usually one)
_ROUTERS: dict[str, weakref.WeakSet[Any]] = {}
_LOCK = threading.Lock()


def register(pool: str, router: Any) -> None:
    with _LOCK:
        _ROUTERS.setdefault(pool, weakref.WeakSet()).add(router)


def replica_reports(pool: str) -> list[dict[str, Any]]:
    """The latest report of every replica of ``pool`` that a router in this process knows
    (each replica once), at most ``routing_stats_period_s`` old."""
    with _LOCK:
        routers = list(_ROUTERS.get(pool, ()))
    seen: dict[Any, dict[str, Any]] = {}
    for router in routers:
        for rid, replica in dict(router.curr_replicas).items():
            if replica.routing_stats:
                seen[rid] = dict(replica.routing_stats)
    return list(seen.values())
