"""Sampling and stop conditions."""

from __future__ import annotations

import pytest
import torch

from services.engine.request import FinishReason
from services.engine.sampler import sample
from services.engine.sampling_params import SamplingParams

PROMPT = [10, 20, 30, 40, 50]


def _collect(eng):
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    return outs


def test_same_seed_same_tokens_different_seed_differs(make_engine):
    eng = make_engine()
    p = dict(max_tokens=24, temperature=1.0, ignore_eos=True)
    a = eng.generate([PROMPT], SamplingParams(seed=1, **p))
    b = eng.generate([PROMPT], SamplingParams(seed=1, **p))
    c = eng.generate([PROMPT], SamplingParams(seed=2, **p))
    assert a == b and a != c


def test_seeded_request_is_batch_independent(make_engine):
    eng = make_engine(num_kv_blocks=128)
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, seed=3, ignore_eos=True)
    (solo,) = eng.generate([PROMPT], params)
    others = [[7, 8, 9], [100] * 20, [55, 66]]
    batched = eng.generate(
        [*others, PROMPT], [SamplingParams(max_tokens=10, temperature=1.0)] * 3 + [params]
    )
    assert batched[-1] == solo


def test_top_k_one_is_greedy(make_engine):
    eng = make_engine()
    greedy = eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    topk1 = eng.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=9, ignore_eos=True)
    )
    assert greedy == topk1


def test_top_p_and_top_k_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for i in range(200):
        (k,) = sample(logits, [SamplingParams(temperature=1.0, top_k=5)], [i], [0]).tokens
        (p,) = sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [i], [0]).tokens
        assert k in top5 and p in nucleus


def test_logprobs_are_of_the_chosen_tokens(make_engine):
    eng = make_engine()
    eng.add_request(
        "r", PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=True, ignore_eos=True)
    )
    outs = _collect(eng)
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert len(lps) == 6 and all(lp <= 0 for lp in lps)


def test_top_logprobs_are_the_most_likely_tokens_of_each_position(make_engine):
    eng = make_engine()
    sampled = SamplingParams(
        max_tokens=6, temperature=1.0, seed=3, logprobs=True, top_logprobs=4, ignore_eos=True
    )
    eng.add_request("t", PROMPT, sampled)
    eng.add_request("plain", PROMPT, SamplingParams(max_tokens=6, logprobs=True, seed=3))
    outs = _collect(eng)
    got = [o for o in outs if o.request_id == "t"]
    ids = [t for o in got for t in o.new_token_ids]
    lps = [lp for o in got for lp in o.new_logprobs]
    top = [alts for o in got for alts in o.new_top_logprobs]
    assert len(top) == len(ids) == 6
    for token, lp, alts in zip(ids, lps, top, strict=True):
        values = [v for _, v in alts]
        assert len(alts) == 4 and values == sorted(values, reverse=True)
        assert lp <= values[0] + 1e-6  # the chosen token is at most as likely as the best
        if token in dict(alts):
            assert abs(dict(alts)[token] - lp) < 1e-5  # the same distribution
    assert all(o.new_top_logprobs is None for o in outs if o.request_id == "plain")


def test_top_logprobs_rows_ask_for_their_own_count():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
    ]
    out = sample(logits, params, [0, 0, 0], [0, 0, 0])
    assert out.top is not None and [len(t) for t in out.top] == [5, 0, 2]
    ref = torch.log_softmax(logits, -1).topk(5)
    assert [t for t, _ in out.top[0]] == ref.indices[0].tolist()
    assert out.top[2][0][0] == out.tokens[2]  # greedy: the chosen token is the top one


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_logprobs=2),
        dict(logprobs=True, top_logprobs=21),
        dict(logprobs=True, top_logprobs=-1),
    ],
)
def test_bad_top_logprobs_are_refused_by_name(kwargs):
    from services.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.create(**kwargs)
    assert e.value.field == "top_logprobs"


def test_logit_bias_forces_and_forbids_tokens(make_engine):
    eng = make_engine()
    free = eng.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    forced = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=((77, 100.0),))
    assert eng.generate([PROMPT], forced)[0] == [77] * 6
    banned = tuple((t, -100.0) for t in set(free))
    again = eng.generate(
        [PROMPT],
        SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True, logit_bias=banned),
    )[0]
    assert not set(again) & set(free)


def test_min_tokens_holds_back_eos_and_stop_tokens(make_engine):
    eng = make_engine()
    eos_first = SamplingParams(max_tokens=8, temperature=0, logit_bias=((2, 100.0),))  # 2 = EOS
    assert eng.generate([PROMPT], eos_first)[0] == [2]  # ends at once
    held = SamplingParams(max_tokens=8, temperature=0, logit_bias=((2, 100.0),), min_tokens=5)
    out = eng.generate([PROMPT], held)[0]
    assert len(out) == 6 and 2 not in out[:5] and out[5] == 2  # EOS as soon as it may
    stop = SamplingParams(
        max_tokens=8, temperature=0, logit_bias=((9, 100.0),), stop_token_ids=(9,), min_tokens=3
    )
    out = eng.generate([PROMPT], stop)[0]
    assert len(out) == 4 and out[-1] == 9 and 9 not in out[:3]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logit_bias=((5, 101.0),)), "logit_bias"),
        (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
    ],
)
def test_bad_min_tokens_and_logit_bias_are_refused_by_name(kwargs, field):
    from services.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.create(**kwargs)
    assert e.value.field == field


def test_stop_token_ids_and_max_tokens_and_eos(make_engine):
    eng = make_engine()
    (free_run,) = eng.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    stop_at = free_run[4]
    eng.add_request(
        "r", PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,))
    )
    outs = _collect(eng)
    got = [t for o in outs for t in o.new_token_ids]
    assert got == free_run[: free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    eng.add_request("m", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = _collect(eng)
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 3
    # EOS: treat the run's 3rd token as EOS by making it the engine's eos id
    eng.eos_token_ids = frozenset({free_run[2]})
    assert (
        eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
        == free_run[: free_run.index(free_run[2]) + 1]
    )
    assert (
        eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        == free_run
    )


@pytest.mark.slow
def test_stop_strings_truncate_text_and_are_never_streamed(smollm_engine):
    tok = smollm_engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    (free_run,) = smollm_engine.generate([ids], SamplingParams(max_tokens=40, temperature=0))
    full = tok.decode(free_run)
    assert ", 5" in full, full
    smollm_engine.add_request("s", ids, SamplingParams(max_tokens=40, temperature=0, stop=(", 5",)))
    outs = _collect(smollm_engine)
    streamed = "".join(o.new_text for o in outs)
    assert streamed == full[: full.index(", 5")]
    assert outs[-1].finish_reason is FinishReason.STOP
    smollm_engine.check_integrity()
    assert smollm_engine.blocks.num_used_blocks == 0


@pytest.mark.slow
def test_streamed_text_equals_decoded_tokens(smollm_engine):
    tok = smollm_engine.tokenizer
    ids = tok.encode_chat(
        [{"role": "user", "content": "Écris une phrase en français avec des accents."}]
    )
    smollm_engine.add_request("t", ids, SamplingParams(max_tokens=30, temperature=0))
    outs = _collect(smollm_engine)
    assert "".join(o.new_text for o in outs) == tok.decode(
        [t for o in outs for t in o.new_token_ids]
    )
