"""The colocated model and the goodput search of ``services.autoscale.modes``."""

from __future__ import annotations

import pytest

from services.autoscale.modes import goodput_per_replica, simulate_colocated
from services.autoscale.simulator import Costs, Request

COSTS = Costs(prefill_points=((128, 0.1), (512, 0.4), (2048, 1.6)),
              step_points=((1, 0.02), (8, 0.04), (32, 0.1)))  # fmt: skip


def test_a_request_alone_prefills_in_chunks_then_decodes():
    ttft, itl = simulate_colocated([Request(0.0, 2048, 5)], COSTS, 1, budget=1024)
    assert ttft == [pytest.approx(2 * COSTS.prefill_s(1024))]  # two chunks of the budget
    assert itl == [pytest.approx(0.02)]


def test_a_prompt_chunk_slows_the_decodes_it_rides_with():
    reqs = [Request(0.0, 64, 40), Request(0.1, 1024, 2)]
    ttft, itl = simulate_colocated(reqs, COSTS, 1, budget=2048)
    alone, _ = simulate_colocated([Request(0.0, 64, 40)], COSTS, 1)
    assert itl[0] > 0.02 * 1.5  # one gap of the decode took the whole prompt's step
    assert ttft[0] == alone[0]


def test_goodput_is_zero_when_a_prompt_alone_misses_the_ttft_slo():
    assert goodput_per_replica("colocated", 2, COSTS, 2048, 8, 1.0, 0.1) == 0.0
    assert goodput_per_replica("disaggregated", 2, COSTS, 2048, 8, 1.0, 0.1) == 0.0
    assert goodput_per_replica("colocated", 2, COSTS, 128, 8, 1.0, 0.1) > 1.0
