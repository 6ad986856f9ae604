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
- Queued prefill tokens are the ones this router has in flight on the replica, tracked
  exactly by ``on_request_routed`` / ``on_request_completed``. NOTE: not the replica's own
  report: that is up to ``routing_stats_period_s`` old, and a stale "busy" report would pull
  a request away from the replica holding its prefix. With several gateways each one
  balances its own share. Decode choice reads the reports (free blocks, running requests),
  merged with this router's in-flight calls.
- ``prefix_aware=False`` (``routing: least_loaded``) ignores the index: the baseline.
Ranks are single replicas in cost order; Serve sends to the first one whose queue has room.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from services.pd_flow import RouteHint


def index_id(replica_id: Any) -> str:
    """The prefix-index id of a Serve replica (what ``services.replica`` publishes under)."""
    return f"{replica_id.deployment_id.name}-{replica_id.unique_id}"


class PdRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        # internal request id -> (replica, prefill tokens, KV blocks) of calls in flight
        self._inflight: dict[str, tuple[ReplicaID, int, int]] = {}
        self._tokens: Counter[ReplicaID] = Counter()
        self._calls: Counter[ReplicaID] = Counter()
        self._blocks: Counter[ReplicaID] = Counter()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        ranked = sorted(candidate_replicas, key=lambda r: self._key(r, hint))
        return [[r] for r in ranked]

    def _key(self, r: RunningReplica, hint: RouteHint | None) -> tuple[float, ...]:
        stats = r.routing_stats or {}
        rid = r.replica_id
        queued = self._tokens[rid]
        running = max(self._calls[rid], int(stats.get("num_running", 0)))
        free = int(stats.get("blocks_free", 1 << 30))
        if "blocks_total" in stats:
            free = min(free, int(stats["blocks_total"]) - self._blocks[rid])
        tie = random.random()  # equal replicas: spread, never always the first
        if hint is None:
            return (queued, running, tie)
        if hint.computes_prompt:
            cached = hint.cached_tokens.get(index_id(rid), 0) if hint.prefix_aware else 0
            # equal cost: keep the prefix where it is (a copy elsewhere would evict others;
            # and the holder's queue is overestimated: its in-flight work is partly done)
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
                cached = hint.cached_tokens.get(index_id(replica_id), 0) if hint.prefix_aware else 0
                tokens = hint.prompt_tokens - cached
        self._inflight[pending_request.metadata.internal_request_id] = (replica_id, tokens, blocks)
        self._tokens[replica_id] += tokens
        self._calls[replica_id] += 1
        self._blocks[replica_id] += blocks

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entry = self._inflight.pop(internal_request_id, None)
        if entry is None:
            return
        rid, tokens, blocks = entry
        self._tokens[rid] -= tokens
        self._calls[rid] -= 1
        self._blocks[rid] -= blocks

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, v in self._inflight.items() if v[0] == replica_id]:
            self.on_request_completed(replica_id, key)


def _hint(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else None
