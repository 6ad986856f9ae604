"""The SLO planner on synthetic metric series: each pool scales on its own metric, with
hysteresis, delays, cool-downs, pending credit and bounds; and the Ray Serve policy adapter."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from services.autoscale.planner import PlannerState, PoolTarget, Signals, decide
from services.autoscale.policy import SloPolicy, pool_signals

PREFILL = PoolTarget("ttft", 1.0, 1, 4, up_cooldown_s=30, down_cooldown_s=60, up_delay_s=3)
DECODE = PoolTarget("itl", 0.1, 1, 4, up_cooldown_s=30, down_cooldown_s=60, up_delay_s=3)


class Pool:
    """Runs the planner once a second; a new replica serves ``startup_s`` after it is asked
    for. ``latency(t, replicas)`` is the series (it may react to the replica count)."""

    def __init__(self, target: PoolTarget, startup_s: float = 10.0) -> None:
        self.t, self.startup_s = target, startup_s
        self.state = PlannerState()
        self.running, self.starting = target.min_replicas, []  # ready times
        self.history: list[tuple[float, int, str]] = []

    def run(self, latency, t0: float, t1: float, **signals) -> None:  # type: ignore[no-untyped-def]
        now = t0
        while now < t1:
            self.running += sum(1 for r in self.starting if r <= now)
            self.starting = [r for r in self.starting if r > now]
            target = self.running + len(self.starting)
            lat = latency(now, self.running)
            s = Signals(now, self.running, target, lat, **signals)
            d = decide(self.t, s, self.state)
            self.state = d.state
            if d.replicas > target:
                self.starting += [now + self.startup_s] * (d.replicas - target)
            elif d.replicas < target:
                drop = target - d.replicas
                while drop and self.starting:
                    self.starting.pop()
                    drop -= 1
                self.running -= drop
            self.history.append((now, d.replicas, d.reason))
            now += 1.0

    @property
    def target(self) -> int:
        return self.history[-1][1]

    def changes(self) -> list[int]:
        out, last = [], self.history[0][1]
        for _, n, _ in self.history[1:]:
            if n != last:
                out.append(n - last)
                last = n
        return out


def test_a_ttft_miss_scales_prefill_only():
    prefill, decode = Pool(PREFILL), Pool(DECODE)
    prefill.run(lambda t, n: 2.5 / n, 0, 8, requests=10)  # TTFT 2.5x its target
    decode.run(lambda t, n: 0.05, 0, 8, requests=10)  # ITL half its target
    assert prefill.target == 2 and decode.target == 1
    assert [r for _, _, r in prefill.history[:3]] == ["up-delay"] * 3  # a miss must last


def test_an_itl_miss_scales_decode_only():
    prefill, decode = Pool(PREFILL), Pool(DECODE)
    prefill.run(lambda t, n: 0.4, 0, 8, requests=10)
    decode.run(lambda t, n: 0.25 / n, 0, 8, requests=10)
    assert prefill.target == 1 and decode.target == 2


def test_no_second_scale_up_while_a_replica_is_pending():
    pool = Pool(PREFILL, startup_s=20)
    pool.run(lambda t, n: 5.0, 0, 15, requests=10)  # still missing while it starts
    assert pool.target == 2 and pool.changes() == [1]
    assert {r for t, _, r in pool.history if t > 4} == {"pending"}
    # it serves, the miss goes on: one more only after the cool-down from *taking effect*
    pool.run(lambda t, n: 5.0, 15, 60, requests=10)
    ups = [t for (t, n, _), (_, m, _) in zip(pool.history, pool.history[1:], strict=False) if m > n]
    assert pool.changes()[:2] == [1, 1] and ups[1] >= ups[0] + 20 + 30 - 1


def test_a_noisy_series_around_the_target_does_not_flap():
    rng = random.Random(7)
    # one replica: 1.3-1.7x the target; two: 0.65-0.85x, inside the hysteresis band
    pool = Pool(PREFILL)
    pool.run(lambda t, n: rng.uniform(1.3, 1.7) / n, 0, 900, requests=10, busy=0.45)
    assert pool.changes() == [1]  # up once, then holds: never down-then-up
    assert pool.target == 2


def test_short_spikes_do_not_scale():
    pool = Pool(PREFILL)
    pool.run(lambda t, n: 3.0 if t % 20 < 2 else 0.5, 0, 300, requests=10)  # 2 s spikes
    assert pool.changes() == []


def test_scale_down_waits_for_the_cooldown_and_lasting_room():
    t = PoolTarget("ttft", 1.0, 1, 4, up_cooldown_s=30, down_cooldown_s=60, down_delay_s=20)
    pool = Pool(t, startup_s=5)
    pool.run(lambda t, n: 3.0 / n, 0, 20, requests=10)
    assert pool.target >= 2
    up_at = max(
        t for (t, n, _), (_, m, _) in zip(pool.history, pool.history[1:], strict=False) if m > n
    )
    pool.run(lambda t, n: 0.2, 20, 200, requests=5, busy=0.1)  # load gone, still some traffic
    downs = [h for h, nxt in zip(pool.history, pool.history[1:], strict=False) if nxt[1] < h[1]]
    assert downs and downs[0][0] >= up_at + 60 - 1  # not within the cool-down
    assert pool.target == 1


def test_no_scale_down_that_would_overload_the_smaller_pool():
    pool = Pool(PREFILL)
    pool.running = 2
    pool.state = PlannerState()
    # latency looks fine but the replicas compute 50% of the time: one would be 100% busy
    pool.run(lambda t, n: 0.3, 0, 300, requests=10, busy=0.5)
    assert pool.changes() == [] and {r for _, _, r in pool.history[60:]} == {"hold"}


def test_idle_pools_shrink_to_the_minimum():
    t = PoolTarget("itl", 0.1, 1, 4, down_cooldown_s=10, idle_s=30)
    pool = Pool(t)
    pool.running = 3
    pool.run(lambda t, n: None, 0, 100)  # no samples, no requests
    assert pool.target == 1 and pool.changes() == [-1, -1]


def test_bounds_and_step_are_respected():
    t = PoolTarget("ttft", 1.0, 2, 3, max_step=4, up_delay_s=0)
    s = Signals(0.0, 2, 2, latency_s=50.0, requests=10)
    d = decide(t, s, PlannerState())
    assert d.replicas == 3  # 50x the target wants many more; max_replicas caps it
    t1 = PoolTarget("ttft", 1.0, 1, 8, max_step=2, up_delay_s=0)
    assert decide(t1, s, PlannerState()).replicas == 4  # +2 at most per decision
    idle = Signals(1000.0, 2, 2, latency_s=None)
    assert decide(t, idle, PlannerState()).replicas == 2  # never below min_replicas
    for bad in ({"min_replicas": 3, "max_replicas": 2}, {"down_ratio": 1.2}, {"target_s": 0}):
        with pytest.raises(ValueError):
            PoolTarget("ttft", **{"target_s": 1.0, **bad})


def test_load_signals_scale_before_latency_shows_it():
    t = PoolTarget("ttft", 1.0, 1, 4, up_delay_s=0, queued_tokens_per_replica=1000)
    s = Signals(0.0, 1, 1, latency_s=0.5, queued_tokens=2500, requests=10)
    assert decide(t, s, PlannerState()).replicas == 2
    t = PoolTarget("itl", 0.1, 1, 4, up_delay_s=0, kv_usage_high=0.8)
    s = Signals(0.0, 1, 1, latency_s=0.05, kv_usage=0.95, requests=10)
    assert decide(t, s, PlannerState()).replicas == 2


def test_the_ray_policy_weights_replicas_by_samples_and_keeps_state():
    m = {
        "ttft_p": {"a": 3.0, "b": 1.0, "c": 9.0},
        "ttft_n": {"a": 30.0, "b": 10.0, "c": 0.0},  # c has no samples: no weight
        "queued_tokens": {"a": 100.0, "b": 50.0},
        "kv_usage": {"a": 0.2, "b": 0.7},
        "requests": {"a": 3.0, "b": 1.0},
    }
    s = pool_signals("ttft", m, 5.0, 2, 2)
    assert s.latency_s == pytest.approx(2.5) and s.queued_tokens == 150
    assert s.kv_usage == 0.7 and s.requests == 4
    assert pool_signals("itl", m, 5.0, 2, 2).latency_s is None
    policy = SloPolicy(**{"metric": "ttft", "target_s": 1.0, "max_replicas": 3, "up_delay_s": 2})
    state: dict = {}
    replicas = [2]
    for now in range(4):
        ctx = SimpleNamespace(
            current_time=float(now),
            aggregated_metrics=m,
            current_num_replicas=2,
            target_num_replicas=replicas[-1],
            policy_state=state,
            deployment_name="prefill",
        )
        n, state = policy(ctx)
        replicas.append(n)
    # the miss had to last up_delay_s (state carried over), then credit for the pending one
    assert replicas == [2, 2, 2, 3, 3]
    assert state["reason"] and "planner" in state


def test_replica_reports_windowed_percentiles_and_utilisation():
    import dataclasses

    from services.autoscale.window import LatencyWindow
    from services.engine.engine import EngineStats
    from services.replica_metrics import ReplicaMetrics

    w = LatencyWindow(10.0)
    for i in range(10):
        w.add(float(i), now=100.0 + i)
    assert w.snapshot(0.9, now=109.0) == (8.0, 10)
    assert w.snapshot(0.5, now=115.0) == (7.0, 5)  # samples older than 10 s are gone
    assert w.snapshot(0.9, now=200.0) == (None, 0)

    m = ReplicaMetrics(window_s=30.0, busy_window_s=10.0)
    assert m.busy(0.0, now=0.0) == 0.0
    assert m.busy(2.5, now=5.0) == pytest.approx(0.5)
    assert m.busy(2.5, now=25.0) == pytest.approx(0.0)  # idle for the whole last window
    fields = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    stats = EngineStats(**{**fields, "blocks_total": 100, "blocks_used": 25, "num_running": 3})
    m.observe_gap(0.05)
    out = m.autoscaling_stats(stats, busy_s=2.5)
    assert out["itl_n"] == 1 and out["itl_p"] == 0.05 and out["ttft_n"] == 0
    assert out["kv_usage"] == 0.25 and out["requests"] == 3
    assert all(isinstance(v, float) for v in out.values())  # what Ray Serve accepts
    # outside a Serve replica there are no Ray series: the gauges are skipped, not an error
    m.set_gauges(stats, join_waits=2, join_wait_s=0.01)
