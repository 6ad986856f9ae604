"""Continuous batching: every request in a batch gets exactly its solo tokens, with chunked
prefill, prefix-cache hits and forced preemption."""

from __future__ import annotations

import random

from services.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def _solo(make_engine, prompts, params=GREEDY):
    eng = make_engine(num_kv_blocks=64)
    return [eng.generate([p], params)[0] for p in prompts]


def test_batch_equals_solo(make_engine):
    prompts = _prompts(8)
    solo = _solo(make_engine, prompts)
    eng = make_engine(num_kv_blocks=256)
    assert eng.generate(prompts, GREEDY) == solo
    assert eng.stats().num_steps < sum(len(s) for s in solo)  # requests really shared steps


def test_requests_join_and_leave_between_steps(make_engine):
    prompts = _prompts(6, seed=3)
    solo = _solo(make_engine, prompts)
    eng = make_engine(num_kv_blocks=256)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or eng.has_unfinished:
        if pending:  # one new request joins every step while others are mid-decode
            i, p = pending.pop(0)
            eng.add_request(
                f"r{i}", p, SamplingParams(max_tokens=5 + 3 * i, temperature=0, ignore_eos=True)
            )
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i in range(len(prompts)):
        assert got[f"r{i}"] == solo[i][: 5 + 3 * i]


def test_chunked_prefill_equals_solo(make_engine):
    prompts = _prompts(5, seed=1) + [[7] * 150]
    solo = _solo(make_engine, prompts)
    eng = make_engine(num_kv_blocks=256, max_num_batched_tokens=16)
    assert eng.generate(prompts, GREEDY) == solo
    assert eng.stats().prompt_tokens_computed == sum(len(p) for p in prompts)


def test_prefix_cache_hit_computes_only_the_suffix(make_engine):
    rng = random.Random(5)
    shared = [rng.randrange(3, 256) for _ in range(32)]  # 8 full blocks of 4
    a, b = shared + [11, 12, 13], shared + [21, 22]
    solo = _solo(make_engine, [a, b])
    eng = make_engine(num_kv_blocks=128)
    assert eng.generate([a], GREEDY) == [solo[0]]
    before = eng.stats().prompt_tokens_computed
    eng.add_request("b", b, GREEDY)
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == solo[1]
    assert outs[-1].num_cached_tokens == 32
    assert eng.stats().prompt_tokens_computed - before == len(b) - 32
    assert eng.stats().prefix_hit_tokens == 32


def test_fully_cached_prompt_still_computes_its_last_token(make_engine):
    p = list(range(3, 3 + 16))  # exactly 4 full blocks
    solo = _solo(make_engine, [p])
    eng = make_engine()
    assert eng.generate([p], GREEDY) == solo
    assert eng.generate([p], GREEDY) == solo
    assert eng.stats().prefix_hit_tokens == 12  # 3 blocks reused; the last block's token recomputed


def test_preemption_by_recompute_keeps_tokens(make_engine):
    prompts = _prompts(6, seed=2)
    solo = _solo(make_engine, prompts)
    # 6 requests of up to ~80 tokens need far more than 24 blocks of 4: preemption must happen
    eng = make_engine(num_kv_blocks=24)
    assert eng.generate(prompts, GREEDY) == solo
    assert eng.stats().num_preemptions > 0


def test_preemption_with_seeded_sampling_keeps_tokens(make_engine):
    prompts = _prompts(6, seed=4)
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(6)
    ]
    eng = make_engine(num_kv_blocks=128)
    solo = [eng.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    small = make_engine(num_kv_blocks=24, enable_prefix_caching=False)
    assert small.generate(prompts, params) == solo
    assert small.stats().num_preemptions > 0


def test_running_cap(make_engine):
    prompts = _prompts(5, seed=6)
    solo = _solo(make_engine, prompts)
    eng = make_engine(num_kv_blocks=256, max_num_seqs=2)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    got: dict[str, list[int]] = {}
    while eng.has_unfinished:
        assert len(eng.scheduler.running) <= 2
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [got[f"r{i}"] for i in range(5)] == solo
