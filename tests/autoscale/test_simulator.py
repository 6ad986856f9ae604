"""The planner in the deterministic simulator: on a step trace it meets the SLO for at least
90% of the requests after the transition, with fewer replica-seconds than the smallest fixed
allocation sized for the peak; runs are reproducible; costs follow the engine benchmark."""

from __future__ import annotations

import pytest

from services.autoscale.planner import PoolTarget
from services.autoscale.simulator import Costs, simulate, trace

TTFT_S, ITL_S = 2.0, 0.07
PREFILL = PoolTarget("ttft", TTFT_S, 1, 6, up_cooldown_s=20, down_cooldown_s=60)
DECODE = PoolTarget("itl", ITL_S, 1, 6, up_cooldown_s=20, down_cooldown_s=60)
DURATION = 900.0


@pytest.fixture(scope="module")
def step():
    return trace("step", DURATION, 0.2, 1.2, prompt_tokens=256, output_tokens=128, seed=1)


def test_step_trace_meets_the_slo_with_fewer_replica_seconds_than_fixed_for_peak(step):
    since = DURATION / 3 + Costs().startup_s + 10  # the step, one replica start-up, 10 s
    auto = simulate(step, prefill=PREFILL, decode=DECODE)
    met = auto.attainment(TTFT_S, ITL_S, since)
    assert met >= 0.9
    # both pools grew for the peak, each on its own metric, and started from one replica
    assert auto.timeline[0][1:] == (1, 1)
    assert max(t[1] for t in auto.timeline) >= 2 and max(t[2] for t in auto.timeline) >= 2
    before = [t for t in auto.timeline if t[0] < DURATION / 3 - 30]
    assert {t[1:] for t in before} == {(1, 1)}  # the base load needs no more
    fixed = []
    for p in range(1, 5):
        for d in range(1, 5):
            r = simulate(step, prefill=p, decode=d)
            if r.attainment(TTFT_S, ITL_S, since) >= met:
                fixed.append(sum(r.replica_seconds.values()))
    assert fixed, "no fixed allocation up to 4/4 meets the SLO"
    assert sum(auto.replica_seconds.values()) < min(fixed)


def test_runs_are_deterministic(step):
    a = simulate(step, prefill=PREFILL, decode=DECODE)
    b = simulate(list(step), prefill=PREFILL, decode=DECODE)
    assert (a.ttft, a.itl, a.timeline, a.replica_seconds) == (
        b.ttft,
        b.itl,
        b.timeline,
        b.replica_seconds,
    )
    assert trace("burst", 120, 0.5, 2.0, seed=3) == trace("burst", 120, 0.5, 2.0, seed=3)
    assert trace("burst", 120, 0.5, 2.0, seed=3) != trace("burst", 120, 0.5, 2.0, seed=4)


@pytest.mark.parametrize("kind", ["step", "ramp", "burst", "diurnal"])
def test_traces_follow_their_rate_shape(kind):
    reqs = trace(kind, 600, 0.5, 3.0, seed=0)
    times = [r.arrival for r in reqs]
    assert times == sorted(times) and all(0 <= t < 600 for t in times)
    if kind == "burst":  # the peak rate for the last 10 s of every minute
        peak = sum(1 for t in times if t % 60 >= 50) / 100
        base = sum(1 for t in times if t % 60 < 50) / 500
    else:
        lo = {"step": 300, "ramp": 500, "diurnal": 250}[kind]
        peak = sum(1 for t in times if lo <= t < lo + 100) / 100
        base = sum(1 for t in times if t < 100) / 100
    assert peak > 2.5 * base, (kind, peak, base)


def test_costs_interpolate_the_engine_benchmark():
    c = Costs()
    assert c.prefill_s(512) == pytest.approx(1.560)
    assert c.prefill_s(128) < c.prefill_s(256) < c.prefill_s(512)
    assert c.step_s(1) == pytest.approx(0.0596) and c.step_s(32) == pytest.approx(0.2082)
    assert c.step_s(8) < c.step_s(16) < c.step_s(32)
