"""Prompt-lookup speculative decoding is lossless: greedy and seeded requests give exactly the
tokens they give without it, whether drafts are accepted, rejected or cut by a stop."""

from __future__ import annotations

import random

import pytest

from services.engine import scheduler as scheduler_module
from services.engine.config import EngineConfig
from services.engine.ngram import propose
from services.engine.sampling_params import SamplingParams


def test_propose_takes_what_followed_the_latest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose(toks, 2, 3, 1) == [7, 8]  # the latest [1, 2, 3], not the first
    assert propose(toks, 5, 3, 1) == [7, 8, 1, 2, 3]
    assert propose([4, 5, 6], 3, 3, 1) == []  # nothing recurs
    assert propose([5, 6, 5], 3, 3, 1) == [6, 5]  # falls back to shorter n-grams
    assert propose(toks, 0, 3, 1) == []


def _oracle(reference: dict[tuple[int, ...], list[int]], wrong_every: int):
    """A proposer that knows each prompt's true continuation and spoils every
    ``wrong_every``-th draft token, so steps accept some drafts and reject others."""
    calls = {"n": 0}

    def propose_from(tokens, k, n_max, n_min):
        for prompt, cont in reference.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                draft = list(cont[done : done + k])
                calls["n"] += 1
                if draft and calls["n"] % wrong_every == 0:
                    draft[-1] = (draft[-1] + 1) % 256
                return draft
        return []

    return propose_from


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_k=30, seed=5, ignore_eos=True),
        # penalties read the tokens so far: a draft position must see the drafts before it
        SamplingParams(
            max_tokens=20,
            temperature=0,
            ignore_eos=True,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
        ),
    ],
)
def test_speculation_gives_the_tokens_of_plain_decoding(make_engine, monkeypatch, params):
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (2, 9, 23)]
    plain = make_engine(num_kv_blocks=128)
    want, want_lps = _run(plain, prompts, params)
    eng = make_engine(num_kv_blocks=128, speculative_tokens=3)
    monkeypatch.setattr(
        scheduler_module, "propose", _oracle({tuple(p): w for p, w in zip(prompts, want)}, 3)
    )
    got, got_lps = _run(eng, prompts, params)
    assert got == want
    st = eng.stats()
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both paths ran
    assert st.num_steps < plain.stats().num_steps
    if params.logprobs:  # each token's own log-probability, in order
        for g, w in zip(got_lps, want_lps):
            assert g == pytest.approx(w, abs=1e-4)


def _run(eng, prompts, params):
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, params)
    toks: dict[str, list[int]] = {r: [] for r in rids}
    lps: dict[str, list[float]] = {r: [] for r in rids}
    while eng.has_unfinished:
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
    return [toks[r] for r in rids], [lps[r] for r in rids]


def test_a_stop_inside_accepted_drafts_ends_the_output_there(make_engine, monkeypatch):
    prompt = [7, 8, 9, 10, 11]
    free = make_engine().generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    stop_at = free[5]
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop_at,))
    (want,) = make_engine().generate([prompt], params)
    eng = make_engine(speculative_tokens=4)
    monkeypatch.setattr(scheduler_module, "propose", _oracle({tuple(prompt): free}, 1000))
    assert eng.generate([prompt], params) == [want]
    assert want[-1] == stop_at and len(want) <= 6


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: bf16 matmuls on AMX hosts
def test_copy_workload_on_smollm2_accepts_drafts_and_keeps_tokens(dtype):
    from pathlib import Path

    from services.engine.engine import Engine

    text = (Path(__file__).parents[2] / "bench/data/declaration_of_independence.txt").read_text()
    outs, stats = {}, {}
    for k in (0, 4):
        eng = Engine.from_path(
            None, EngineConfig(num_kv_blocks=256, speculative_tokens=k, dtype=dtype)
        )
        tok = eng.tokenizer
        chat = [{"role": "user", "content": "Copy this text exactly:\n\n" + text[:700]}]
        ids = tok.encode(tok.apply_chat_template(chat))
        # a first request caches the prompt: the runs below compute only its tail, a step
        # short enough to fuse (it must round as it does without speculation)
        eng.generate([ids], SamplingParams(max_tokens=4, temperature=0))
        # tokens and log-probabilities, bit for bit (the logprobs catch a row that rounds
        # differently even where the argmax survives it)
        greedy = SamplingParams(max_tokens=48, temperature=0, logprobs=True)
        seeded = SamplingParams(max_tokens=48, temperature=0.7, seed=2, logprobs=True)
        outs[k] = [_run(eng, [ids], greedy), _run(eng, [ids], seeded)]
        stats[k] = eng.stats()
    assert outs[4] == outs[0]
    # measured: 38 of 138 drafts over the two runs (the seeded run accepts fewer)
    assert stats[4].num_accepted_tokens > 0.2 * stats[4].num_draft_tokens > 0
    assert stats[4].num_steps < stats[0].num_steps
