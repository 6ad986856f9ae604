"""Request router: which prefill or decode replica serves a call (a Ray Serve RequestRouter).

Why Ray Serve's request router API: it is Serve's own extension point for replica choice.
The handle in the gateway's process calls ``choose_replicas`` for every call with the call's
arguments, and Serve keeps doing the rest: replica discovery as pools scale or replicas die,
``max_ongoing_requests`` backpressure (a full replica is skipped for the next in rank),
retries with backoff, and the ``record_routing_stats`` poll of each replica. A router of our
own outside Serve would have to rebuild all of that and call replica actors directly.

Scoring (the gateway has already looked the prompt up in the prefix index, one round trip,
and passes what it found as the call's ``route`` keyword, a ``RouteHint``):
- A call that computes the prompt (prefill pool; the decode pool for a prompt prefilled
  there): cost = the replica's queued prefill tokens + the prompt tokens it would compute
  (prompt minus the prefix it holds). Least cost first; at equal cost the longer cached
  prefix, then the least loaded (cold prompts: the least loaded). So a replica holding a long
  shared prefix wins until its queue outweighs what it saves.
- A decode-only call (its KV comes from a prefill replica): replicas with room for its
  blocks first, then fewest running requests, then most free KV blocks.
- Queued prefill tokens are what is left of the calls this router has in flight on the
  replica (``on_request_routed`` / ``on_request_completed``), drained at the replica's
  measured prefill rate (``queued_tokens``). NOTE: not the replica's own
  report: that is up to ``routing_stats_period_s`` old, and a stale "busy" report would pull
  a request away from the replica holding its prefix. With several gateways each one
  balances its own share. Decode choice reads the reports (free blocks, running requests),
  merged with this router's in-flight calls.
- ``prefix_aware=False`` (``routing: least_loaded``) ignores the index: the baseline.
Ranks are single replicas in cost order; Serve sends to the first one whose queue has room.

Each router also registers under its pool (``request_router_kwargs``), so the gateway's
``/metrics`` reads every replica's latest report at scrape time
(``services.router_registry``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from services import router_registry
from services.pd_flow import RouteHint

log = logging.getLogger(__name__)


def index_id(replica_id: Any) -> str:
    """The prefix-index id of a Serve replica (what ``services.replica`` publishes under)."""
    return f"{replica_id.deployment_id.name}-{replica_id.unique_id}"


# prefill calls shorter than this say more about per-call overhead than compute speed
_RATE_MIN_TOKENS = 256
_RATE_EWMA = 0.3


@dataclass(slots=True)
class _Call:
    replica: ReplicaID
    tokens: int  # prefill tokens it computes (0: decode-only)
    blocks: int
    at: float  # when it was routed (monotonic)


class PdRequestRouter(RequestRouter):
    """Invariants: Serve calls the hooks from more than one thread (routing runs on the
    router's loop, completions arrive on the caller's), so every read and write of the
    bookkeeping holds ``_lock``; and a failure inside the policy never strands a request: it
    is logged and the call goes to any replica."""

    def initialize_state(self, **kwargs: Any) -> None:
        pool = kwargs.get("pool")
        if pool is not None:
            router_registry.register(str(pool), self)
        self._lock = threading.Lock()
        self._now = time.monotonic  # a seam for the unit tests' clock
        self._inflight: dict[str, _Call] = {}  # by Serve's internal request id
        self._rate: dict[ReplicaID, float] = {}  # measured prefill tokens/s, per replica
        self._last_done: dict[ReplicaID, float] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        try:
            hint = _hint(pending_request)
            now = self._now()
            with self._lock:
                ranked = sorted(candidate_replicas, key=lambda r: self._key(r, hint, now))
            return [[r] for r in ranked]
        except Exception:  # a bug in the policy must not hang the request
            log.exception("request router failed; routing this call to any replica")
            return [list(candidate_replicas)]

    def queued_tokens(self, rid: ReplicaID, now: float) -> float:
        """Prefill tokens still to compute on ``rid`` from this router's calls: the calls
        drain first-in first-out at the replica's measured rate (all of them until a rate is
        known), so a cold prompt routed 2 s ago no longer counts in full. Holds ``_lock``."""
        return self._load(rid, now)[0]

    def _load(self, rid: ReplicaID, now: float) -> tuple[float, int, int]:
        """(queued prefill tokens, calls, KV blocks) this router has in flight on ``rid``."""
        calls = sorted(
            (c.at, c.tokens, c.blocks) for c in self._inflight.values() if c.replica == rid
        )
        blocks = sum(b for _, _, b in calls)
        rate = self._rate.get(rid)
        if rate is None:
            return float(sum(t for _, t, _ in calls)), len(calls), blocks
        finish = 0.0
        for at, tokens, _ in calls:
            finish = max(finish, at) + tokens / rate
        return max(0.0, finish - now) * rate, len(calls), blocks

    def _key(self, r: RunningReplica, hint: RouteHint | None, now: float) -> tuple[float, ...]:
        stats = r.routing_stats or {}
        rid = r.replica_id
        queued, calls, blocks = self._load(rid, now)
        running = max(calls, int(stats.get("num_running", 0)))
        free = int(stats.get("blocks_free", 1 << 30))
        if "blocks_total" in stats:
            free = min(free, int(stats["blocks_total"]) - blocks)
        tie = random.random()  # equal replicas: spread, never always the first
        if hint is None:
            return (queued, running, tie)
        if hint.computes_prompt:
            cached = _cached(hint, rid)
            # equal cost: keep the prefix where it is (a copy elsewhere would evict others)
            return (queued + hint.prompt_tokens - cached, -cached, queued, running, tie)
        return (float(free < hint.kv_blocks), running, -free, tie)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hint = _hint(pending_request)
        tokens = blocks = 0
        if hint is not None:
            blocks = hint.kv_blocks
            if hint.computes_prompt:
                tokens = hint.prompt_tokens - _cached(hint, replica_id)
        call = _Call(replica_id, tokens, blocks, self._now())
        with self._lock:
            self._inflight[pending_request.metadata.internal_request_id] = call

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            self._complete(internal_request_id)

    def _complete(self, internal_request_id: str) -> None:
        call = self._inflight.pop(internal_request_id, None)
        if call is None:
            return
        rid = call.replica
        now = self._now()
        # service time: since it was routed, or since the replica's previous call finished
        service = now - max(call.at, self._last_done.get(rid, call.at))
        self._last_done[rid] = now
        if call.tokens >= _RATE_MIN_TOKENS and service > 0:
            sample = call.tokens / service
            old = self._rate.get(rid)
            self._rate[rid] = sample if old is None else old + _RATE_EWMA * (sample - old)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        with self._lock:
            for key in [k for k, c in self._inflight.items() if c.replica == replica_id]:
                self._complete(key)
            self._rate.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


def _cached(hint: RouteHint, rid: ReplicaID) -> int:
    return hint.cached_tokens.get(index_id(rid), 0) if hint.prefix_aware else 0


def _hint(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else None
