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
- What a replica holds is the index's answer or, if longer, what this router sent it in the
  last ``_HELD_S`` (the prompt's block hashes ride the hint): the index learns of new blocks
  only after the replica computed and published them, and a follow-up turn or a burst sharing
  a system prompt often arrives sooner (a second turn once went to the replica without its
  conversation because the index had not caught up).
- A call counts on the replica ranked first from the moment it is ranked (a tentative entry,
  dropped after ``_TENTATIVE_S``), not only once Serve reports it routed: that report
  follows a round trip to the replica, and calls ranked in between would all see the same
  idle replica and pile onto it.
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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from services import router_registry
from services.engine.block_hash import BlockHash
from services.pd_flow import RouteHint

log = logging.getLogger(__name__)


def index_id(replica_id: Any) -> str:
    """The prefix-index id of a Serve replica (what ``services.replica`` publishes under)."""
    return f"{replica_id.deployment_id.name}-{replica_id.unique_id}"


# prefill calls shorter than this say more about per-call overhead than compute speed
_RATE_MIN_TOKENS = 256
_RATE_EWMA = 0.3
# a routed prompt's blocks count as held this long (covers the index's publish lag; after
# it the index, which also sees evictions, is the only word)
_HELD_S = 5.0
# a ranked call not yet reported routed counts this long (Serve's accept round trip; a call
# cancelled while waiting never reports)
_TENTATIVE_S = 2.0


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
        self._ranked: dict[str, _Call] = {}  # ranked first, not yet reported routed
        # block hash -> when this router last sent a prompt with it, per replica (oldest first)
        self._held: dict[ReplicaID, OrderedDict[BlockHash, float]] = {}
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
            key = pending_request.metadata.internal_request_id if pending_request else None
            with self._lock:
                self._ranked.pop(key, None)  # a retry's earlier ranking is not load
                self._expire(now)
                ranked = sorted(candidate_replicas, key=lambda r: self._key(r, hint, now))
                if key is not None and ranked:
                    self._ranked[key] = self._call(ranked[0].replica_id, hint, now)
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
        ranked = [c for c in self._ranked.values() if now - c.at <= _TENTATIVE_S]
        calls = sorted(
            (c.at, c.tokens, c.blocks)
            for c in [*self._inflight.values(), *ranked]
            if c.replica == rid
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
            cached = self._cached(hint, rid, now)
            # equal cost: keep the prefix where it is (a copy elsewhere would evict others)
            return (queued + hint.prompt_tokens - cached, -cached, queued, running, tie)
        return (float(free < hint.kv_blocks), running, -free, tie)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hint = _hint(pending_request)
        key = pending_request.metadata.internal_request_id
        with self._lock:
            now = self._now()
            self._ranked.pop(key, None)
            self._inflight[key] = self._call(replica_id, hint, now)
            if hint is not None and hint.computes_prompt and hint.prefix_aware:
                held = self._held.setdefault(replica_id, OrderedDict())
                for h in hint.block_hashes:
                    held[h] = now
                    held.move_to_end(h)

    def _call(self, rid: ReplicaID, hint: RouteHint | None, now: float) -> _Call:
        tokens = blocks = 0
        if hint is not None:
            blocks = hint.kv_blocks
            if hint.computes_prompt:
                tokens = hint.prompt_tokens - self._cached(hint, rid, now)
        return _Call(rid, tokens, blocks, now)

    def _cached(self, hint: RouteHint, rid: ReplicaID, now: float) -> int:
        """Prompt tokens ``rid`` holds (or will once its calls run): the index's answer, or
        the run of the prompt's leading blocks this router sent it within ``_HELD_S``."""
        if not hint.prefix_aware:
            return 0
        indexed = hint.cached_tokens.get(index_id(rid), 0)
        held = self._held.get(rid)
        run = 0
        if held:
            for h in hint.block_hashes:
                at = held.get(h)
                if at is None or now - at > _HELD_S:
                    break
                run += 1
        return max(indexed, run * hint.block_size)

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._ranked.items() if now - c.at > _TENTATIVE_S]:
            del self._ranked[key]
        for held in self._held.values():
            while held:
                h, at = next(iter(held.items()))
                if now - at <= _HELD_S:
                    break
                del held[h]

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
            for key in [k for k, c in self._ranked.items() if c.replica == replica_id]:
                del self._ranked[key]
            self._rate.pop(replica_id, None)
            self._held.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


def _hint(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else None
