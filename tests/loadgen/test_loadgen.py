"""``pdserve bench`` pieces alone: workloads, arrival schedules, statistics, plots."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from services.loadgen import stats, workload
from services.loadgen.client import Arrivals, Record, Target, _body


def test_lengths_parse_draw_within_bounds_and_refuse_nonsense():
    rng = random.Random(0)
    assert workload.Length.parse("fixed:12").draw(rng) == 12
    assert workload.Length.parse("7").draw(rng) == 7
    u = workload.Length.parse("uniform:10:20")
    assert all(10 <= u.draw(rng) <= 20 for _ in range(200))
    xs = [workload.Length.parse("lognormal:200:50").draw(rng) for _ in range(4000)]
    assert statistics.mean(xs) == pytest.approx(200, rel=0.05)
    assert statistics.stdev(xs) == pytest.approx(50, rel=0.1)
    assert min(workload.Length.parse("normal:2:50").draw(rng) for _ in range(200)) == 1
    for bad in ("gauss:1:2", "normal:1", "fixed:x", ""):
        with pytest.raises(ValueError, match="is not fixed"):
            workload.Length.parse(bad)


def test_workloads_are_seeded_and_shaped():
    cfg = workload.WorkloadConfig(
        requests=10, input_len=workload.Length("fixed", 30), output_len=workload.Length("fixed", 5)
    )
    a, b = workload.build("random", cfg), workload.build("random", cfg)
    assert a == b and len(a) == 10 and len({c.turns[0].text for c in a}) == 10
    assert all(len(c.turns[0].text.split()) == 30 and c.turns[0].max_tokens == 5 for c in a)
    multi = workload.build(
        "multiturn", workload.WorkloadConfig(requests=10, turns=4, system_len=50)
    )
    assert [len(c.turns) for c in multi] == [4, 4, 2]
    assert len({c.system for c in multi}) == 1 and len(multi[0].system.split()) == 50
    long_prompt = workload.build("long-prompt", cfg)
    assert statistics.mean(len(c.turns[0].text.split()) for c in long_prompt) > 1000
    long_out = workload.build("long-output", cfg)
    assert statistics.mean(c.turns[0].max_tokens for c in long_out) > 300
    with pytest.raises(ValueError, match="unknown workload"):
        workload.build("nope", cfg)


def test_the_words_are_single_tokens_of_the_default_model(smollm_engine):
    tok = smollm_engine.tokenizer
    text = workload.words(random.Random(1), 400)
    assert len(tok.encode(" " + text, add_special_tokens=False)) == 400


def test_a_multiturn_body_carries_the_conversation_so_far():
    conv = workload.Conversation("sys", (workload.Turn("a", 3), workload.Turn("b", 4)))
    chat = _body(Target("http://x", "m", chat=True), conv, 1, ["A"])
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user"]
    assert [m["content"] for m in chat["messages"]] == ["sys", "a", "A", "b"]
    assert chat["max_tokens"] == 4 and chat["stream_options"] == {"include_usage": True}
    plain = _body(Target("http://x", "m", ignore_eos=False), conv, 1, ["A"])
    assert plain["prompt"] == "sys\na\nA\nb" and "ignore_eos" not in plain


def test_poisson_arrivals_are_seeded_with_the_asked_rate():
    offs = Arrivals(rate=4.0, seed=3).offsets(4000)
    assert offs == Arrivals(rate=4.0, seed=3).offsets(4000) and offs[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offs)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean
    for bad in (dict(), dict(rate=1.0, concurrency=2), dict(rate=0.0), dict(concurrency=0)):
        with pytest.raises(ValueError):
            Arrivals(**bad)


def _rec(ttft, e2e, n, itls=(), error=None, prompt=10):
    return Record(0, 0, 0.0, ttft, e2e, list(itls), prompt, n, error)


def test_summary_percentiles_throughput_and_goodput():
    recs = [
        _rec(0.5, 1.5, 11, [0.1] * 10),  # TPOT 0.1: meets both
        _rec(1.0, 3.0, 11, [0.2] * 10),  # TPOT 0.2: misses TPOT
        _rec(3.0, 3.5, 6, [0.1] * 5),  # misses TTFT
        _rec(None, None, 0, error="HTTP 500"),
    ]
    s = stats.summarize(recs, 10.0, stats.Slo(ttft_s=2.0, tpot_s=0.15))
    assert (s["requests"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["ttft_s"]["p50"] == 1.0 and s["ttft_s"]["p99"] == pytest.approx(2.96)
    assert s["tpot_s"]["mean"] == pytest.approx((0.1 + 0.2 + 0.1) / 3)
    assert s["output_throughput"] == pytest.approx(2.8) and s["request_throughput"] == 0.3
    assert s["goodput"] == pytest.approx(0.1) and s["slo_attainment"] == 0.25
    assert stats.percentile([], 50) != stats.percentile([], 50)  # NaN
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert "TTFT p50/p99" in stats.table([{"label": "rate 1/s", "summary": s}])


def test_plots_are_pngs(tmp_path):
    from services.loadgen import plots

    recs = [_rec(0.1 * i, 0.5 + 0.1 * i, 5, [0.05] * 4).as_dict() for i in range(1, 20)]
    runs = []
    for rate in (1.0, 2.0):
        s = stats.summarize(
            [Record(**{k: v for k, v in r.items() if k != "tpot_s"}) for r in recs],
            5.0,
            stats.Slo(),
        )
        runs.append({"label": f"rate {rate}", "rate": rate, "summary": s, "records": recs})
    for path in (plots.cdfs(runs, tmp_path / "a.png"), plots.sweep(runs, tmp_path / "b.png")):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not math.isnan(runs[0]["summary"]["goodput"])
