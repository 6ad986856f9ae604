"""Where disaggregation pays: goodput per replica of disaggregated and colocated serving for a
prompt/output mix and a pair of SLOs, DistServe's way (the highest Poisson rate at which 90% of
requests meet both SLOs, divided by the replicas it takes).

- Disaggregated: ``services.autoscale.simulator`` with fixed pools, every split of the
  replicas into prefill and decode tried, the best one kept.
- Colocated (modelled here): each replica runs vLLM-style chunked prefill: a step carries its
  whole decode batch and, within ``budget`` tokens, a chunk of the oldest waiting prompt; a step
  costs ``step_s(batch) + prefill_s(chunk)`` (the two parts add: the step log of ``pdserve
  doctor`` measures exactly this interference). A prompt's first token comes when its last
  chunk is done; the request then joins its replica's decode batch. New requests go to the
  replica with the least work outstanding.
Deterministic: seeded arrivals, ties by index.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.autoscale.simulator import Costs, Request, simulate, trace

ATTAINMENT = 0.9


@dataclass(slots=True)
class _Colo:
    prompts: list[list[int]] = field(default_factory=list)  # [request, tokens left to prefill]
    running: list[int] = field(default_factory=list)
    stepping: bool = False

    def outstanding(self, left: list[int]) -> float:
        return sum(p[1] for p in self.prompts) + sum(left[i] for i in self.running)


def simulate_colocated(
    requests: Sequence[Request], costs: Costs, replicas: int, budget: int = 1024
) -> tuple[list[float], list[float]]:
    """Per request: TTFT and mean ITL (inf where it never finished)."""
    n = len(requests)
    ttft, gaps = [math.inf] * n, [[] for _ in range(n)]
    last = [0.0] * n
    left = [max(0, r.output_tokens - 1) for r in requests]
    reps = [_Colo() for _ in range(replicas)]
    events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, request or replica)
    seq = 0

    def push(t: float, kind: int, x: int) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, x))
        seq += 1

    ARRIVE, STEP = 0, 1
    for i, r in enumerate(requests):
        push(r.arrival, ARRIVE, i)
    chunks: dict[int, tuple[int, int, list[int]]] = {}  # replica -> (request, chunk, batch)

    def start(k: int, now: float) -> None:
        rep = reps[k]
        if rep.stepping or not (rep.prompts or rep.running):
            return
        batch = list(rep.running[: costs.max_batch])
        room = max(0, budget - len(batch))
        head, chunk = -1, 0
        if rep.prompts and room:
            head, chunk = rep.prompts[0][0], min(rep.prompts[0][1], room)
        if not batch and not chunk:
            return
        dt = (costs.step_s(len(batch)) if batch else 0.0) + (
            costs.prefill_s(chunk) if chunk else 0.0
        )
        rep.stepping = True
        chunks[k] = (head, chunk, batch)
        push(now + dt, STEP, k)

    while events:
        now, kind, _, x = heapq.heappop(events)
        if kind == ARRIVE:
            k = min(range(replicas), key=lambda j: (reps[j].outstanding(left), j))
            reps[k].prompts.append([x, requests[x].prompt_tokens])
            start(k, now)
            continue
        rep = reps[x]
        rep.stepping = False
        head, chunk, batch = chunks.pop(x)
        for i in batch:
            gaps[i].append(now - last[i])
            last[i] = now
            left[i] -= 1
        rep.running = [i for i in rep.running if left[i] > 0]
        if chunk:
            rep.prompts[0][1] -= chunk
            if rep.prompts[0][1] == 0:
                rep.prompts.pop(0)
                ttft[head] = now - requests[head].arrival
                last[head] = now
                if left[head] > 0:
                    rep.running.append(head)
        start(x, now)
    itl = [sum(g) / len(g) if g else (0.0 if math.isfinite(ttft[i]) else math.inf)
           for i, g in enumerate(gaps)]  # fmt: skip
    return ttft, itl


def _attains(ttft: Sequence[float], itl: Sequence[float], slo_ttft: float, slo_itl: float) -> float:
    ok = sum(1 for a, b in zip(ttft, itl, strict=True) if a <= slo_ttft and b <= slo_itl)
    return ok / len(ttft) if ttft else 1.0


def attainment(
    mode: str, rate: float, replicas: int, costs: Costs, prompt: int, output: int,
    slo_ttft: float, slo_itl: float, n_requests: int = 200, seed: int = 0,
) -> float:  # fmt: skip
    """SLO attainment at ``rate`` requests/s; for disaggregated, the best prefill/decode split."""
    reqs = trace("step", n_requests / rate, rate, rate, prompt_tokens=prompt,
                 output_tokens=output, seed=seed)  # fmt: skip
    if mode == "colocated":
        return _attains(*simulate_colocated(reqs, costs, replicas), slo_ttft, slo_itl)
    best = 0.0
    for p in range(1, replicas):
        res = simulate(reqs, costs, prefill=p, decode=replicas - p)
        best = max(best, res.attainment(slo_ttft, slo_itl))
    return best


def goodput_per_replica(
    mode: str, replicas: int, costs: Costs, prompt: int, output: int,
    slo_ttft: float, slo_itl: float,
) -> float:  # fmt: skip
    """The highest rate (requests/s, to 2%) at which ``ATTAINMENT`` of requests meet both SLOs,
    per replica; 0 when even a trickle misses them."""
    lo, hi = 0.0, 0.05
    if attainment(mode, 0.01, replicas, costs, prompt, output, slo_ttft, slo_itl) < ATTAINMENT:
        return 0.0  # the SLOs are out of reach even alone (a prompt's prefill exceeds TTFT)
    while attainment(mode, hi, replicas, costs, prompt, output, slo_ttft, slo_itl) >= ATTAINMENT:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            break
    while hi - lo > 0.02 * hi and hi > 0.01:
        mid = (lo + hi) / 2
        if attainment(mode, mid, replicas, costs, prompt, output, slo_ttft, slo_itl) >= ATTAINMENT:
            lo = mid
        else:
            hi = mid
    return lo / replicas
