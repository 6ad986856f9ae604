"""A deterministic discrete-event model of both pools, to replay arrival traces through the
SLO planner and report SLO attainment and replica-seconds.

Model (costs from the engine benchmark, BENCHMARKS.md "Engine vs Hugging Face transformers"):
- Prefill replica: prompts run one after another (prefill is compute-bound; a replica's token
  budget is shared by whatever it batches), each taking ``Costs.prefill_s(tokens)``; a new
  prompt goes to the ready replica that frees up first (what routing by queued work does).
  TTFT = its queue wait + its compute; the first token comes from the prefill replica.
- KV transfer: ``transfer_s`` later the request joins the decode replica with the fewest
  requests; a decode replica steps its whole batch (at most ``max_batch``; the rest wait) in
  ``Costs.step_s(batch)``, one token per request per step; ITL = the gaps a request sees.
- Scaling: the planner runs every ``interval_s`` per pool on the signals replicas would report
  (latency percentile over ``window_s``, queued prefill tokens, requests, KV use ~ batch
  share); a new replica serves ``startup_s`` after the decision (model load); a removed one
  takes no new work and is counted until its queue drains. Replica-seconds count from the
  decision to start until the end of the drain.
Same inputs, same output: arrivals come from a seeded generator and ties break by index.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.autoscale.planner import PlannerState, PoolTarget, Signals, decide
from services.autoscale.window import LatencyWindow


def _interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear through ``points``, extended by the end slopes (through 0 below)."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1] * x / points[0][0]
    (x0, y0), (x1, y1) = points[min(i, len(points) - 1) - 1], points[min(i, len(points) - 1)]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class Costs:
    """Per-request costs. Defaults: SmolLM2-135M fp32, one CPU thread (engine benchmark)."""

    # (prompt tokens, prefill seconds)
    prefill_points: tuple[tuple[float, float], ...] = ((128, 0.377), (512, 1.560), (2048, 7.748))
    # (running requests, decode step seconds)
    step_points: tuple[tuple[float, float], ...] = ((1, 0.0596), (8, 0.0755), (32, 0.2082))
    transfer_s: float = 0.01
    startup_s: float = 20.0
    max_batch: int = 32

    def prefill_s(self, tokens: int) -> float:
        return _interp(self.prefill_points, tokens)

    def step_s(self, batch: int) -> float:
        return max(self.step_points[0][1], _interp(self.step_points, batch))


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float
    prompt_tokens: int
    output_tokens: int


def trace(
    kind: str,
    duration_s: float,
    base_rps: float,
    peak_rps: float,
    *,
    prompt_tokens: int = 256,
    output_tokens: int = 64,
    seed: int = 0,
) -> list[Request]:
    """Poisson arrivals whose rate follows ``kind``: ``step`` (base, then peak from a third of
    the way on), ``ramp`` (base to peak linearly), ``burst`` (base, peak for 10 s of every
    60 s), ``diurnal`` (one sine period between base and peak)."""

    def rate(t: float) -> float:
        if kind == "step":
            return peak_rps if t >= duration_s / 3 else base_rps
        if kind == "ramp":
            return base_rps + (peak_rps - base_rps) * t / duration_s
        if kind == "burst":
            return peak_rps if t % 60 >= 50 else base_rps
        if kind == "diurnal":
            return (
                base_rps + (peak_rps - base_rps) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2
            )
        raise ValueError(f"unknown trace kind {kind!r}: step, ramp, burst or diurnal")

    rng = random.Random(seed)
    top = max(base_rps, peak_rps)
    out, t = [], 0.0
    while True:  # thinning: candidates at the top rate, kept with probability rate(t)/top
        t += rng.expovariate(top)
        if t >= duration_s:
            return out
        if rng.random() < rate(t) / top:
            out.append(Request(t, prompt_tokens, output_tokens))


@dataclass(slots=True)
class _Replica:
    started: float  # when it was asked for (replica-seconds count from here)
    ready: float  # when it serves
    retired: float | None = None  # no new work from here
    free_at: float = 0.0  # prefill: when its queue drains
    queued_tokens: list[tuple[float, int]] = field(default_factory=list)  # prefill: (done, n)
    running: list[int] = field(default_factory=list)  # decode: request indices
    waiting: list[int] = field(default_factory=list)
    stepping: bool = False
    drained_at: float | None = None
    work: list[tuple[float, float]] = field(default_factory=list)  # compute intervals

    def busy(self, now: float, window_s: float) -> float:
        """Fraction of the last ``window_s`` (or of its life, if shorter) spent computing."""
        since = max(now - window_s, self.ready)
        self.work = [(a, b) for a, b in self.work if b > now - window_s]  # NOTE: one window
        spent = sum(max(0.0, min(b, now) - max(a, since)) for a, b in self.work)
        return spent / (now - since) if now > since else 0.0


@dataclass(slots=True)
class SimResult:
    requests: list[Request]
    ttft: list[float]
    itl: list[float]  # mean gap per request (0 for single-token outputs)
    finish: list[float]
    timeline: list[tuple[float, int, int]]  # (time, prefill replicas, decode replicas) targets
    replica_seconds: dict[str, float]

    def attainment(self, ttft_s: float, itl_s: float, since: float = 0.0) -> float:
        """Share of requests arriving at or after ``since`` that met both targets."""
        idx = [i for i, r in enumerate(self.requests) if r.arrival >= since]
        ok = sum(1 for i in idx if self.ttft[i] <= ttft_s and self.itl[i] <= itl_s)
        return ok / len(idx) if idx else 1.0


class _Pool:
    def __init__(
        self, name: str, n: int, target: PoolTarget | None, window_s: float, pct: float
    ) -> None:
        self.name, self.target = name, target
        self.replicas = [_Replica(0.0, 0.0) for _ in range(n)]
        self.state = PlannerState()
        self.window = LatencyWindow(window_s)
        self.pct = pct

    def live(self) -> list[_Replica]:
        return [r for r in self.replicas if r.retired is None]

    def ready(self, now: float) -> list[_Replica]:
        return [r for r in self.live() if r.ready <= now]


def simulate(
    requests: Sequence[Request],
    costs: Costs = Costs(),
    *,
    prefill: PoolTarget | int = 1,
    decode: PoolTarget | int = 1,
    interval_s: float = 1.0,
    window_s: float = 10.0,
    busy_window_s: float = 60.0,
) -> SimResult:
    """Replay ``requests``. Each pool is a fixed replica count or a ``PoolTarget`` (then it
    starts at ``min_replicas`` and the planner sizes it)."""
    pools = {}
    for name, spec in (("prefill", prefill), ("decode", decode)):
        if isinstance(spec, PoolTarget):
            pools[name] = _Pool(name, spec.min_replicas, spec, window_s, spec.percentile)
        else:
            pools[name] = _Pool(name, spec, None, window_s, 0.9)
    P, D = pools["prefill"], pools["decode"]
    n = len(requests)
    ttft, finish = [math.inf] * n, [math.inf] * n
    gaps: list[list[float]] = [[] for _ in range(n)]
    last_tok = [0.0] * n
    left = [max(0, r.output_tokens - 1) for r in requests]
    events: list[tuple[float, int, int, object]] = []  # (time, kind order, seq, payload)
    seq = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, payload))
        seq += 1

    ARRIVE, FIRST, JOIN, STEP, TICK = 0, 1, 2, 3, 4
    for i, r in enumerate(requests):
        push(r.arrival, ARRIVE, i)
    end = (requests[-1].arrival if requests else 0.0) + 600.0
    push(0.0, TICK, None)
    timeline: list[tuple[float, int, int]] = []

    def start_step(rep: _Replica, now: float) -> None:
        while rep.waiting and len(rep.running) < costs.max_batch:
            rep.running.append(rep.waiting.pop(0))
        if rep.running and not rep.stepping:
            rep.stepping = True
            rep.work.append((now, now + costs.step_s(len(rep.running))))
            push(rep.work[-1][1], STEP, rep)

    def wanted(pool: _Pool) -> int:
        return len(pool.live())

    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == ARRIVE:
            i = payload
            assert isinstance(i, int)
            ready = P.ready(now) or P.live()  # nothing ready yet: queue on a starting one
            rep = min(ready, key=lambda r: (max(r.free_at, r.ready), P.replicas.index(r)))
            begin = max(now, rep.free_at, rep.ready)
            rep.free_at = begin + costs.prefill_s(requests[i].prompt_tokens)
            rep.work.append((begin, rep.free_at))
            rep.queued_tokens.append((rep.free_at, requests[i].prompt_tokens))
            ttft[i] = rep.free_at - requests[i].arrival
            push(rep.free_at, FIRST, i)  # NOTE: the replica reports it once it exists
            last_tok[i] = rep.free_at
            if left[i] == 0:
                finish[i] = rep.free_at
            else:
                push(rep.free_at + costs.transfer_s, JOIN, i)
        elif kind == FIRST:
            i = payload
            assert isinstance(i, int)
            P.window.add(ttft[i], now)
        elif kind == JOIN:
            i = payload
            assert isinstance(i, int)
            cands = D.ready(now) or D.live()
            rep = min(cands, key=lambda r: (len(r.running) + len(r.waiting), D.replicas.index(r)))
            rep.waiting.append(i)
            if rep.ready <= now:
                start_step(rep, now)
            else:
                push(rep.ready, STEP, ("wake", rep))
        elif kind == STEP:
            if isinstance(payload, tuple):  # a starting replica became ready
                start_step(payload[1], now)
                continue
            rep = payload
            assert isinstance(rep, _Replica)
            rep.stepping = False
            done = []
            for i in rep.running:
                gap = now - last_tok[i]
                gaps[i].append(gap)
                D.window.add(gap, now)
                last_tok[i] = now
                left[i] -= 1
                if left[i] == 0:
                    finish[i] = now
                    done.append(i)
            rep.running = [i for i in rep.running if i not in done]
            start_step(rep, now)
            if rep.retired is not None and not rep.running and not rep.waiting:
                rep.drained_at = now
        else:  # TICK: one planner decision per autoscaled pool
            for pool in (P, D):
                for rep in pool.replicas:  # prefill work that finished leaves the queue
                    rep.queued_tokens = [(t, k) for t, k in rep.queued_tokens if t > now]
                if pool.target is None:
                    continue
                p, _cnt = pool.window.snapshot(pool.pct, now)
                ready = pool.ready(now)
                if pool is P:
                    queued = sum(k for r in P.live() for _, k in r.queued_tokens)
                    reqs = sum(len(r.queued_tokens) for r in P.live())
                    kv = 0.0
                else:
                    queued = 0.0
                    reqs = sum(len(r.running) + len(r.waiting) for r in D.live())
                    kv = max((len(r.running) / costs.max_batch for r in ready), default=0.0)
                busy = [r.busy(now, busy_window_s) for r in ready]
                mean_busy = sum(busy) / len(busy) if busy else None
                sig = Signals(now, len(ready), wanted(pool), p, queued, kv, reqs, mean_busy)
                d = decide(pool.target, sig, pool.state)
                pool.state = d.state
                while d.replicas > wanted(pool):
                    pool.replicas.append(_Replica(now, now + costs.startup_s))
                while d.replicas < wanted(pool):
                    # retire a starting replica first, else the least busy ready one
                    live = pool.live()
                    rep = max(live, key=lambda r: (r.ready, -len(r.running) - r.free_at))
                    rep.retired = now
                    if not rep.running and not rep.waiting:
                        # a ready prefill replica still works through its queue until free_at
                        busy_until = rep.free_at if pool is P and rep.ready <= now else now
                        rep.drained_at = max(now, busy_until)
            timeline.append((now, wanted(P), wanted(D)))
            pending = any(not math.isfinite(f) for f in finish)
            if pending and now < end:
                push(now + interval_s, TICK, None)
    stop = max((f for f in finish if math.isfinite(f)), default=0.0)
    seconds = {}
    for name, pool in pools.items():
        total = 0.0
        for r in pool.replicas:
            until = stop if r.retired is None else (r.drained_at or max(r.retired, r.free_at))
            total += max(0.0, min(until, stop) - r.started)
        seconds[name] = total
    itl = [sum(g) / len(g) if g else 0.0 for g in gaps]
    return SimResult(list(requests), ttft, itl, finish, timeline, seconds)
