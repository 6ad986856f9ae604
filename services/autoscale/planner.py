"""The SLO planner: one pool's desired replica count from its latency against its target and
its load signals. Pure and deterministic (time is an argument), so the simulator, the unit
tests and the Ray Serve policy all run the very same rule.

The rule, per decision:
1. ``ratio`` = the pool's recent latency percentile (TTFT for prefill, ITL for decode) / target.
   Load signals stand in before latency shows it: queued prefill tokens per replica (prefill),
   KV-cache usage (decode). ``pressure`` = the largest of ratio and the load ratios.
2. Up when pressure has stayed above ``up_ratio`` for ``up_delay_s``: by ceil(current x (pressure - 1)), at least 1, at most
   ``max_step``; not while replicas are still starting (the miss they will fix is already paid
   for: *pending credit*), and not within ``up_cooldown_s`` of the last scale-up *taking
   effect* (its replicas serving), so the latency window first shows what it changed.
3. Down (at most ``max_step``) only when pressure < ``down_ratio`` *and* the pool one replica
   smaller would stay under ``up_ratio`` and under ``max_busy`` compute utilisation (latency
   alone hides how close a queue is to blowing up), and not within ``down_cooldown_s`` of the
   last change, and all that for ``down_delay_s`` in a row (a dip in a noisy load is not
   room); or when the pool has been idle for ``idle_s``.
4. Clamp to [min_replicas, max_replicas].
The band between ``down_ratio`` and ``up_ratio`` is the hysteresis that stops flapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """What an operator sets for one pool."""

    metric: Literal["ttft", "itl"]
    target_s: float
    min_replicas: int = 1
    max_replicas: int = 4
    percentile: float = 0.9  # of the recent window
    up_ratio: float = 1.0  # scale up above target x this
    down_ratio: float = 0.6  # scale down only below target x this
    max_step: int = 1  # replicas added or removed per decision
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    up_delay_s: float = 5.0  # a miss must last this long
    down_delay_s: float = 60.0  # room must last this long
    idle_s: float = 60.0  # no traffic this long: shrink toward min_replicas
    # load signals (0 = unused): queued prefill tokens per replica that count as a full miss,
    # and the KV-cache usage fraction that does
    queued_tokens_per_replica: float = 0.0
    kv_usage_high: float = 0.0
    max_busy: float = 0.7  # a scale-down may not push compute utilisation above this

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"bounds: 0 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if not 0 < self.down_ratio < self.up_ratio:
            raise ValueError("hysteresis: need 0 < down_ratio < up_ratio")
        if self.target_s <= 0 or self.max_step < 1 or not 0 < self.percentile < 1:
            raise ValueError("target_s > 0, max_step >= 1 and 0 < percentile < 1 are required")


@dataclass(frozen=True, slots=True)
class Signals:
    """One pool's state at decision time (from replica reports)."""

    now: float
    running_replicas: int  # serving now
    target_replicas: int  # the current target: > running while replicas start
    latency_s: float | None  # the percentile over the recent window; None = no samples
    queued_tokens: float = 0.0  # prefill tokens waiting, whole pool
    kv_usage: float = 0.0  # fraction of KV blocks in use, busiest replica
    requests: float = 0.0  # running + waiting requests, whole pool
    busy: float | None = None  # mean fraction of time the replicas computed; None = unknown


@dataclass(frozen=True, slots=True)
class PlannerState:
    last_change: float = -math.inf  # time of the last scale decision (either way)
    last_busy: float | None = None  # last time the pool had work (None: not seen yet)
    direction: int = 0  # +1 / -1 of the last change
    settled: float = -math.inf  # when the last change took effect (every replica serving)
    high_since: float | None = None  # start of the current run of misses
    low_since: float | None = None  # start of the current run of room


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    state: PlannerState
    reason: str
    pressure: float


def pressure(t: PoolTarget, s: Signals, replicas: int) -> float:
    """Load relative to what ``replicas`` replicas handle within target (1.0 = exactly)."""
    current = max(1, s.running_replicas)
    p = 0.0
    if s.latency_s is not None:
        # NOTE: latency spread over ``replicas`` instead of ``current`` scales with the load
        # per replica, to first order (queueing makes it steeper; this errs toward caution)
        p = s.latency_s / t.target_s * current / max(1, replicas)
    if t.queued_tokens_per_replica > 0:
        p = max(p, s.queued_tokens / (t.queued_tokens_per_replica * max(1, replicas)))
    if t.kv_usage_high > 0:
        p = max(p, s.kv_usage / t.kv_usage_high * current / max(1, replicas))
    return p


def decide(t: PoolTarget, s: Signals, state: PlannerState) -> Decision:
    current = s.running_replicas
    active = s.requests > 0 or s.queued_tokens > 0 or (s.latency_s is not None)
    if active or state.last_busy is None:  # NOTE: idleness is observed, never assumed
        state = replace(state, last_busy=s.now)
    p = pressure(t, s, current)
    since_change = s.now - state.last_change

    def out(n: int, reason: str) -> Decision:
        n = min(t.max_replicas, max(t.min_replicas, n))
        if n != s.target_replicas:
            direction = 1 if n > s.target_replicas else -1
            return Decision(n, replace(state, last_change=s.now, direction=direction), reason, p)
        return Decision(n, state, reason, p)

    if s.target_replicas < t.min_replicas or s.target_replicas > t.max_replicas:
        return out(s.target_replicas, "bounds")
    if s.target_replicas > current:
        return out(s.target_replicas, "pending")  # credit: starting replicas answer this miss
    if state.settled < state.last_change:
        state = replace(state, settled=s.now)
    if p > t.up_ratio:
        state = replace(state, low_since=None, high_since=_since(state.high_since, s.now))
        if state.direction > 0 and s.now - state.settled < t.up_cooldown_s:
            return out(current, "up-cooldown")
        if s.now - state.high_since < t.up_delay_s:
            return out(current, "up-delay")
        step = min(t.max_step, max(1, math.ceil(current * (p / t.up_ratio - 1))))
        state = replace(state, high_since=None)
        return out(current + step, f"miss x{p:.2f}")
    state = replace(state, high_since=None)
    if current <= t.min_replicas:
        return out(current, "at-min")
    assert state.last_busy is not None
    if not active and s.now - state.last_busy >= t.idle_s and since_change >= t.down_cooldown_s:
        return out(current - t.max_step, "idle")
    fewer = _room(t, s, current, p)
    if fewer is None:
        state = replace(state, low_since=None)
        return out(current, "hold")
    state = replace(state, low_since=_since(state.low_since, s.now))
    if since_change < t.down_cooldown_s:
        return out(current, "down-cooldown")
    if s.now - state.low_since < t.down_delay_s:
        return out(current, "down-delay")
    state = replace(state, low_since=None)
    return out(fewer, f"room x{p:.2f}")


def _since(start: float | None, now: float) -> float:
    return now if start is None else start


def _room(t: PoolTarget, s: Signals, current: int, p: float) -> int | None:
    """The smallest pool (at most ``max_step`` fewer) that would stay within target, or None."""
    if p >= t.down_ratio:
        return None
    for step in range(min(t.max_step, current - t.min_replicas), 0, -1):
        fewer = current - step
        busy_ok = s.busy is None or s.busy * current / fewer <= t.max_busy
        if pressure(t, s, fewer) < t.up_ratio and busy_ok:
            return fewer
    return None
