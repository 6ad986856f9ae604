"""The engine's step costs by what each step carried (``services.engine.step_log``)."""

from __future__ import annotations

import pytest

from services.engine.sampling_params import SamplingParams
from services.engine.step_log import StepLog, rows_bucket


def test_buckets_and_totals():
    assert [rows_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [0, 1, 2, 4, 8, 8, 16]
    log = StepLog()
    log.record(3, 0, 0.010, 0.008)
    log.record(4, 0, 0.012, 0.004)
    log.record(4, 100, 0.050, 0.050)
    log.record(0, 512, 0.200, 0.125)
    assert log.snapshot() == [
        {"rows": 0, "with_prompt": True, "steps": 1, "seconds": 0.2, "decode_rows": 0,
         "prompt_tokens": 512, "cpu_seconds": 0.125},
        {"rows": 4, "with_prompt": False, "steps": 2, "seconds": 0.022, "decode_rows": 7,
         "prompt_tokens": 0, "cpu_seconds": 0.012},
        {"rows": 4, "with_prompt": True, "steps": 1, "seconds": 0.05, "decode_rows": 4,
         "prompt_tokens": 100, "cpu_seconds": 0.05},
    ]  # fmt: skip


def test_the_engine_logs_every_step_and_describes_itself(make_engine):
    eng = make_engine(num_kv_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eng.generate([[6] * 3, [5] * 40], params)  # the short one decodes beside the long one
    steps = eng.step_log.snapshot()
    assert sum(b["steps"] for b in steps) == eng.stats().num_steps
    assert sum(b["prompt_tokens"] for b in steps) == 43  # every prompt token, once
    assert sum(b["decode_rows"] for b in steps) == 2 * 4  # tokens after each first
    assert any(b["with_prompt"] and b["rows"] > 0 for b in steps)  # a chunk beside a decode
    # the engine thread's CPU time in its steps: some, and never more than their wall time
    cpu, wall = sum(b["cpu_seconds"] for b in steps), sum(b["seconds"] for b in steps)
    assert 0 < cpu <= wall * 1.01 + 1e-3
    p = eng.profile()
    assert p["max_num_batched_tokens"] == 16 and p["num_kv_blocks"] == 64
    assert p["weight_bytes"] > 0 and p["kv_bytes_per_token"] > 0 and p["dtype"] == "float32"
    assert p["read_gbps"] > 0.1
    # fp32, tied: the lm_head is the embedding, packed once: 4 bytes a step parameter
    assert p["weight_bytes"] == pytest.approx(4 * p["step_params"], rel=0.01)
