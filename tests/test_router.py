"""The request router's policy on stand-in replicas (no cluster): what it ranks first."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from ray.serve._private.common import DeploymentID, ReplicaID

from services.engine.block_hash import hash_blocks
from services.pd_flow import RouteHint
from services.router import PdRequestRouter, index_id


@dataclass
class _Replica:  # the two attributes of RunningReplica the router reads
    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _router() -> PdRequestRouter:
    r = PdRequestRouter.__new__(PdRequestRouter)  # the policy only; no Serve machinery
    r.initialize_state()
    r._now = _Clock()  # time stands still unless a test moves it
    return r


def _replicas(n: int, deployment: str = "prefill") -> list[_Replica]:
    dep = DeploymentID(name=deployment, app_name="app")
    return [_Replica(ReplicaID(unique_id=f"r{i}", deployment_id=dep)) for i in range(n)]


def _pending(hint: RouteHint | None, rid: str = "x"):  # type: ignore[no-untyped-def]
    return SimpleNamespace(
        kwargs={} if hint is None else {"route": hint},
        metadata=SimpleNamespace(internal_request_id=rid),
    )


def _first(router, replicas, hint, rid="x"):  # type: ignore[no-untyped-def]
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(hint, rid)))
    assert [len(r) for r in ranks] == [1] * len(replicas)  # one replica per rank, all ranked
    return ranks[0][0]


def test_the_replica_holding_the_prefix_wins_until_its_queue_outweighs_the_saving():
    router, (a, b) = _router(), _replicas(2)
    hint = RouteHint(1000, {index_id(b.replica_id): 960}, True, 64)
    for _ in range(5):  # idle: the holder, every time
        assert _first(router, [a, b], hint) is b
    # one cold 1,000-token prompt in flight on b: 1,040 against 1,000 on a
    router.on_request_routed(_pending(RouteHint(1000), "c"), b.replica_id, None)
    assert _first(router, [a, b], hint) is a
    # 960 in flight: equal cost (1,000 each), and b keeps its prefix rather than copy it to a
    router.on_request_completed(b.replica_id, "c")
    router.on_request_routed(_pending(RouteHint(960), "c"), b.replica_id, None)
    assert _first(router, [a, b], hint) is b
    router.on_request_completed(b.replica_id, "c")
    # 3 cold 1,000-token prompts in flight on b: 3,000 + 40 queued > 1,000 on a
    for i in range(3):
        router.on_request_routed(_pending(RouteHint(1000), f"q{i}"), b.replica_id, None)
    assert _first(router, [a, b], hint) is a
    for i in range(3):  # they finish: back to the holder
        router.on_request_completed(b.replica_id, f"q{i}")
    assert _first(router, [a, b], hint) is b


def test_cold_prompts_and_least_loaded_go_by_queued_tokens():
    router, (a, b) = _router(), _replicas(2)
    router.on_request_routed(_pending(RouteHint(500), "q"), a.replica_id, None)
    assert _first(router, [a, b], RouteHint(100)) is b  # cold: the less loaded
    baseline = RouteHint(1000, {index_id(a.replica_id): 960}, True, 64, prefix_aware=False)
    assert _first(router, [a, b], baseline) is b  # least-loaded ignores the cached prefix
    # only the uncached part of a routed request counts as its queued work
    router.on_request_completed(a.replica_id, "q")
    hit = RouteHint(1000, {index_id(a.replica_id): 960}, True, 64)
    router.on_request_routed(_pending(hit, "h"), a.replica_id, None)
    assert router.queued_tokens(a.replica_id, router._now()) == 40


def test_a_failing_policy_still_routes_the_call():
    router, replicas = _router(), _replicas(2)
    hint = RouteHint(100, {"prefill-r0": "not a number"}, True, 8)  # type: ignore[dict-item]
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(hint)))
    assert ranks == [replicas]  # any replica, rather than a request that waits forever


def test_bookkeeping_is_safe_across_threads():
    import threading

    router, replicas = _router(), _replicas(2)
    for i in range(3000):  # a long in-flight table: each ranking walks it
        router.on_request_routed(_pending(RouteHint(500), f"old-{i}"), replicas[0].replica_id, None)
    stop = threading.Event()

    def churn(k: int) -> None:  # completions arrive on another thread than routing
        i = 0
        while not stop.is_set():
            rid = f"{k}-{i}"
            router.on_request_routed(
                _pending(RouteHint(500), rid), replicas[i % 2].replica_id, None
            )
            router.on_request_completed(replicas[i % 2].replica_id, rid)
            i += 1

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so unguarded iteration would break
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            ranks = asyncio.run(router.choose_replicas(replicas, _pending(RouteHint(100))))
            assert len(ranks) == 2  # the policy's ranking, never the failure fallback
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert len(router._inflight) == 3000


def test_queued_work_drains_at_the_measured_prefill_rate():
    router, (a, b) = _router(), _replicas(2)
    clock = router._now
    # no rate measured yet: everything in flight counts
    router.on_request_routed(_pending(RouteHint(1000), "m"), a.replica_id, None)
    clock.t += 2.0
    assert router.queued_tokens(a.replica_id, clock.t) == 1000
    router.on_request_completed(a.replica_id, "m")  # 1,000 tokens in 2 s: 500 tokens/s
    # two calls routed together drain one after the other
    router.on_request_routed(_pending(RouteHint(1000), "p"), a.replica_id, None)
    router.on_request_routed(_pending(RouteHint(500), "q"), a.replica_id, None)
    assert router.queued_tokens(a.replica_id, clock.t) == 1500
    clock.t += 1.0
    assert router.queued_tokens(a.replica_id, clock.t) == 1000
    clock.t += 3.0  # past the estimate (the calls are slower than measured): nothing left
    assert router.queued_tokens(a.replica_id, clock.t) == 0
    # so a holder that has been busy a while wins its prefix back sooner than "full" counting
    router.on_request_completed(a.replica_id, "p")
    router.on_request_completed(a.replica_id, "q")
    router.on_request_routed(_pending(RouteHint(1000), "r"), a.replica_id, None)
    clock.t += 1.5  # most of it done at the measured ~425-500 tokens/s
    hint = RouteHint(1000, {index_id(a.replica_id): 960}, True, 64)
    assert _first(router, [a, b], hint) is a  # what is left + 40 < 1,000


def test_decode_by_room_for_the_blocks_then_running_then_free_blocks():
    router, (a, b, c) = _router(), _replicas(3, "decode")
    a.routing_stats = {"num_running": 0, "blocks_free": 10, "blocks_total": 100}  # no room
    b.routing_stats = {"num_running": 3, "blocks_free": 90, "blocks_total": 100}
    c.routing_stats = {"num_running": 1, "blocks_free": 50, "blocks_total": 100}
    hint = RouteHint(300, {}, computes_prompt=False, kv_blocks=20)
    assert _first(router, [a, b, c], hint) is c
    c.routing_stats = {"num_running": 3, "blocks_free": 50, "blocks_total": 100}
    assert _first(router, [a, b, c], hint) is b  # equal batch: more free blocks


def test_a_dead_replicas_in_flight_work_is_forgotten():
    router, (a,) = _router(), _replicas(1)
    router.on_request_routed(_pending(RouteHint(800), "q"), a.replica_id, None)
    # the base class's own replica bookkeeping, empty here (no Serve machinery)
    router._replicas, router._replica_id_set, router._queue_len_gauge_last_update = {}, set(), {}
    router.on_replica_actor_died(a.replica_id)
    assert router.queued_tokens(a.replica_id, router._now()) == 0 and not router._inflight


def test_calls_ranked_before_serve_reports_them_routed_spread():
    """Serve reports a call routed only after the replica accepted it (a round trip): calls
    ranked in between count on the replica ranked first, so a burst does not pile up."""
    router, (a, b) = _router(), _replicas(2)
    first = _first(router, [a, b], RouteHint(500), "p")
    second = _first(router, [a, b], RouteHint(500), "q")
    assert first is not second
    assert _first(router, [a, b], RouteHint(500), "q") is second  # its own retry is not load
    # reported routed elsewhere (the first rank was full): it counts there instead
    router.on_request_routed(_pending(RouteHint(500), "p"), second.replica_id, None)
    assert router.queued_tokens(first.replica_id, router._now()) == 0
    assert router.queued_tokens(second.replica_id, router._now()) == 1000
    # a ranked call that never reports (cancelled while waiting) stops counting
    router._now.t += 2.5
    assert router.queued_tokens(second.replica_id, router._now()) == 500
    router.on_request_completed(second.replica_id, "p")
    _first(router, [a, b], RouteHint(10), "r")  # a ranking expires the stale entries
    assert not router._ranked.keys() - {"r"}


def test_a_prompt_routed_moments_ago_counts_as_held_before_the_index_has_it():
    router, (a, b) = _router(), _replicas(2)
    prompt = list(range(96))
    turn0 = hash_blocks(prompt, 16)
    turn1 = hash_blocks([*prompt, *range(500, 532)], 16)  # the conversation so far + more
    router.on_request_routed(_pending(_hinted(96, turn0), "t0"), b.replica_id, None)
    router.on_request_completed(b.replica_id, "t0")
    # the index has not caught up (no cached tokens in the hint): b still wins, for 96 tokens
    follow = _hinted(128, turn1)
    for _ in range(5):
        assert _first(router, [a, b], follow, "t1") is b
    router.on_request_routed(_pending(follow, "t1"), b.replica_id, None)
    assert router.queued_tokens(b.replica_id, router._now()) == 128 - 96
    router.on_request_completed(b.replica_id, "t1")
    # past the hold the index is the only word: cold everywhere, so the less loaded
    router._now.t += 6.0
    router.on_request_routed(_pending(RouteHint(50), "busy"), b.replica_id, None)
    assert _first(router, [a, b], follow) is a
    # least-loaded routing ignores what it sent where
    router.on_request_completed(b.replica_id, "busy")
    router.on_request_routed(_pending(_hinted(96, turn0), "t2"), b.replica_id, None)
    router.on_request_completed(b.replica_id, "t2")
    router.on_request_routed(_pending(RouteHint(50), "busy"), b.replica_id, None)
    assert _first(router, [a, b], replace(follow, prefix_aware=False)) is a
    assert _first(router, [a, b], follow) is b


def _hinted(n: int, hashes) -> RouteHint:  # type: ignore[no-untyped-def]
    return RouteHint(n, {}, True, 16, block_hashes=tuple(hashes), block_size=16)
