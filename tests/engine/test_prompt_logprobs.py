"""Prompt log-probabilities (``prompt_logprobs``, what ``echo`` reports): equal to
transformers' on the same fp32 weights, whole or in prefill chunks, on a prefix-cache hit,
after a preemption, and from the prefill side of a P/D handoff."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.sampling_params import SamplingParams
from tests.fixtures import prefill_for_handoff


def _hf_scores(hf, prompt: list[int], k: int):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt))).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)[:-1]
    chosen = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    values, ids = lp.topk(k, dim=-1)
    return chosen, ids.tolist(), values.tolist()


def _collect(eng, rid):
    outs = []
    while eng.has_unfinished:
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def _check(got, want, k):
    chosen, ids, values = want
    assert len(got) == len(chosen)
    for (lp, alts), c, i, v in zip(got, chosen, ids, values, strict=True):
        assert lp == pytest.approx(c, abs=1e-4)
        assert [t for t, _ in alts] == i[:k]
        assert [x for _, x in alts] == pytest.approx(v[:k], abs=1e-4)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()


@pytest.mark.parametrize("chunk", [1024, 8, 5])
def test_prompt_logprobs_equal_transformers(hf, make_engine, chunk):
    prompt = [random.Random(2).randrange(3, 256) for _ in range(29)]
    want = _hf_scores(hf, prompt, 3)
    eng = make_engine(num_kv_blocks=128, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, ignore_eos=True)
    for rid in ("a", "b"):  # b: the whole prompt is in the prefix cache after a
        eng.add_request(rid, prompt, params)
        outs = _collect(eng, rid)
        got = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(got) == 1 and outs[0].prompt_logprobs is got[0]  # once, with the first token
        _check(got[0], want, 3)
    # and the output is what it is without scoring the prompt
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert eng.generate([prompt], plain) == eng.generate([prompt], params)


def test_prompt_logprobs_survive_preemption(hf, make_engine):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(24)] for _ in range(3)]
    eng = make_engine(num_kv_blocks=20, block_size=4)
    params = SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert eng.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        got = [o.prompt_logprobs for o in outs if o.request_id == str(i) and o.prompt_logprobs]
        assert len(got) == 1
        _check(got[0], _hf_scores(hf, p, 1), 0)


def test_the_prefill_side_scores_the_prompt(hf, make_engine):
    prompt = [random.Random(4).randrange(3, 256) for _ in range(17)]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)
    pre, dec = make_engine(role="prefill"), make_engine(role="decode")
    (first,), handle = prefill_for_handoff(pre, "r", prompt, params)
    _check(first.prompt_logprobs, _hf_scores(hf, prompt, 2), 2)
    dec.add_request("r", prompt, params, kv_handle=handle)
    assert all(o.prompt_logprobs is None for o in _collect(dec, "r"))  # sent once, by prefill
