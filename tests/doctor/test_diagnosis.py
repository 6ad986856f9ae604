"""The doctor's answers on evidence built to show one fault each, and a clean bill on a
healthy cluster (``services.doctor.diagnosis``, pure)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from services.doctor.diagnosis import FINE, LOOK, UNKNOWN, diagnose
from services.doctor.evidence import Evidence
from services.loadgen.stats import Slo

SLO = Slo(ttft_s=2.0, tpot_s=0.1)


def _replica(pool: str, steps: list[dict[str, Any]], **stats: float) -> dict[str, Any]:
    profile = {
        "pool": pool, "dtype": "float32", "matmul_dtype": "bfloat16", "quantization": "int4",
        "kv_cache_dtype": "float32", "weight_bytes": 100e6, "step_params": 150e6,
        "read_gbps": 20.0, "kv_bytes_per_token": 40_000, "block_size": 16,
        "num_kv_blocks": 1024, "max_model_len": 8192, "max_num_seqs": 64,
        "max_num_batched_tokens": 1024, "speculative_tokens": 0,
    }  # fmt: skip
    base = dict(num_running=0, num_waiting=0, num_held=0, blocks_total=1024, blocks_free=900,
                blocks_used=124, blocks_cached=0, prompt_tokens_computed=10_000,
                prefill_tokens_queued=0, prefix_hit_tokens=0, num_preemptions=0, num_steps=100,
                num_draft_tokens=0, num_accepted_tokens=0)  # fmt: skip
    base.update(stats)
    return {"identity": f"{pool}-x", "profile": profile, "stats": base, "steps": steps}


def _bucket(rows: int, with_prompt: bool, steps: int, step_s: float, chunk: int = 0,
            cpu: float = 0.97):  # fmt: skip
    """``cpu``: the share of the steps' wall time the engine thread ran."""
    return {"rows": rows, "with_prompt": with_prompt, "steps": steps, "seconds": steps * step_s,
            "decode_rows": rows * steps, "prompt_tokens": chunk * steps,
            "cpu_seconds": cpu * steps * step_s}  # fmt: skip


def _record(ttft=0.3, tpot=0.03, out=32, prompt=256, queue=0.05, prefill=0.15, kv=0.02):
    e2e = ttft + tpot * (out - 1)
    return {"error": None, "start_s": 0.0, "ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot,
            "itls": [tpot] * (out - 1), "prompt_tokens": prompt, "output_tokens": out,
            "server": {"queue_s": queue, "prefill_s": prefill, "kv_transfer_s": kv,
                       "ttft_s": ttft - 0.01}}  # fmt: skip


def _evidence(records=None, decode=None, prefill=None, mode="disaggregated", concurrency=4):
    healthy_decode = [_bucket(1, False, 50, 0.008), _bucket(4, False, 200, 0.012)]
    cluster = {
        "model": "m", "mode": mode, "conditional_threshold": 0, "routing": "prefix_aware",
        "pools": {
            "prefill": [prefill or _replica("prefill", [_bucket(0, True, 40, 0.2, 256)])],
            "decode": [decode or _replica("decode", healthy_decode)],
        },
    }  # fmt: skip
    runs = [{"concurrency": concurrency, "records": records or [_record() for _ in range(20)]}]
    return Evidence("test", cluster, runs)


def _verdicts(ev: Evidence) -> list[str]:
    return [a.verdict for a in diagnose(ev, SLO)]


def test_a_healthy_cluster_gets_a_clean_bill():
    answers = diagnose(_evidence(), SLO)
    assert [a.number for a in answers] == [1, 2, 3, 4, 5, 6]
    assert [a.verdict for a in answers] == [FINE] * 6, [(a.number, a.cause) for a in answers]


def test_a_kv_pool_too_small_for_the_load():
    small = _replica("decode", [_bucket(4, False, 200, 0.012)], num_preemptions=37,
                     blocks_used=60, blocks_total=64)  # fmt: skip
    small["profile"]["num_kv_blocks"] = 64  # 1,024 tokens: 3 requests of 288
    a = diagnose(_evidence(decode=small, concurrency=8), SLO)[3]
    assert a.verdict == LOOK and "KV" in a.cause and "kv_cache_dtype: int8" in a.action
    assert a.figures["preemptions"] == 37 and a.figures["requests_that_fit"] < 8


def test_one_decode_replica_under_heavy_decode_load():
    busy = _replica("decode", [_bucket(1, False, 5, 0.008), _bucket(64, False, 400, 0.16)])
    slow = [_record(tpot=0.16) for _ in range(20)]
    answers = diagnose(_evidence(records=slow, decode=busy, concurrency=64), SLO)
    a = answers[2]
    assert a.verdict == LOOK and "add a decode replica" in a.action and "64 rows" in a.cause
    assert answers[1].verdict == FINE  # TTFT is not the problem


def test_a_decode_engine_that_waits_for_its_cores():
    """Steps of the right size whose thread ran half their wall time: the decode pool shares
    its cores; on a GPU the same share is the device's time and no finding."""
    starved = [_bucket(1, False, 50, 0.02, cpu=0.5), _bucket(4, False, 200, 0.12, cpu=0.5)]
    slow = [_record(tpot=0.12) for _ in range(20)]
    a = diagnose(_evidence(records=slow, decode=_replica("decode", starved)), SLO)[2]
    assert a.verdict == LOOK and "ran for 50% of its steps' wall time" in a.cause, a.cause
    assert "decode.cpus" in a.action
    assert a.figures["decode_engine_cpu_share"] == pytest.approx(0.5)
    on_gpu = _replica("decode", starved)
    on_gpu["profile"]["device"] = "cuda:0"
    a = diagnose(_evidence(records=slow, decode=on_gpu), SLO)[2]
    assert "a decode step of 4 rows takes 120 ms" in a.cause, a.cause  # the next finding
    assert math.isnan(a.figures["decode_engine_cpu_share"])
    # a replica that does not report the engine thread's CPU time: unknown, no finding
    old = _replica("decode", [{k: v for k, v in b.items() if k != "cpu_seconds"} for b in starved])
    a = diagnose(_evidence(records=slow, decode=old), SLO)[2]
    assert "ran for" not in a.cause and math.isnan(a.figures["decode_engine_cpu_share"])


def test_a_chunk_budget_that_lets_long_prefills_stall_decodes():
    stalled = _replica("decode", [
        _bucket(1, False, 50, 0.008), _bucket(4, False, 100, 0.012),
        _bucket(4, True, 60, 0.25, 4096),
    ], prompt_tokens_computed=245_760)  # fmt: skip
    stalled["profile"]["max_num_batched_tokens"] = 4096
    slow = [_record(tpot=0.15) for _ in range(20)]
    a = diagnose(_evidence(records=slow, decode=stalled, mode="colocated"), SLO)[2]
    assert a.verdict == LOOK and "stall" in a.cause and "max_num_batched_tokens" in a.action
    assert a.figures["prefill_interference"] > 10
    # the mode advice quotes the simulator at this load's mix and the cluster's own costs
    assert "simulated at this load's mix" in a.action and "requests/s per replica" in a.action


def test_stalls_are_found_when_no_pure_step_has_the_mixed_steps_batch():
    """A light load may mix prompts only into one-row steps while the pure steps ran at 2
    and 4 rows: the mixed step is compared with the nearest larger batch."""
    stalled = _replica("decode", [
        _bucket(2, False, 30, 0.010), _bucket(4, False, 30, 0.012),
        _bucket(1, True, 8, 1.5, 400),
    ], prompt_tokens_computed=3_600)  # fmt: skip
    slow = [_record(tpot=0.3) for _ in range(9)]
    a = diagnose(_evidence(records=slow, decode=stalled, mode="colocated"), SLO)[2]
    assert a.verdict == LOOK and "stall" in a.cause, a.cause
    assert a.figures["prefill_interference"] == pytest.approx(1.5 / 0.010)


def test_costs_measured_from_the_step_log():
    from services.doctor.diagnosis import measured_costs

    costs = measured_costs(_evidence())
    assert costs.prefill_s(512) == pytest.approx(512 * 0.2 / 256)  # 0.2 s per 256-token prompt
    assert costs.step_points == ((1.0, 0.008), (4.0, 0.012))
    bench_only = Evidence("bench", None, [{"concurrency": 2, "records": [_record()]}])
    assert measured_costs(bench_only) is None


def test_ttft_names_its_largest_part():
    queued = [_record(ttft=3.0, queue=2.5, prefill=0.4) for _ in range(20)]
    a = diagnose(_evidence(records=queued), SLO)[1]
    assert a.verdict == LOOK and "queue" in a.cause and "prefill replica" in a.action
    moved = [_record(ttft=2.5, queue=0.1, prefill=0.3, kv=2.0) for _ in range(20)]
    a = diagnose(_evidence(records=moved), SLO)[1]
    assert "kv_transfer" in a.cause and "conditional_threshold" in a.action


def test_quantization_helps_a_bandwidth_bound_fp32_decode():
    dense = _replica("decode", [_bucket(1, False, 300, 0.031)])
    dense["profile"].update(quantization="none", matmul_dtype="float32", weight_bytes=600e6)
    slow = [_record(tpot=0.12) for _ in range(20)]
    a = diagnose(_evidence(records=slow, decode=dense), SLO)[4]
    assert a.verdict == LOOK and "quantization: int4" in a.action
    assert a.figures["floor_ms_now"] == 30.0


def test_a_bench_report_alone_answers_what_it_can():
    ev = Evidence("bench", None, [{"concurrency": 2, "records": [_record() for _ in range(5)]}])
    assert _verdicts(ev)[:2] == [FINE, FINE] and _verdicts(ev)[3:] == [UNKNOWN] * 3
