"""Presence, frequency and repetition penalties: exact arithmetic, the tokens of an
independent reference loop over transformers' logits, and no effect from speculation."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.errors import InvalidRequestError
from services.engine.sampler import _penalize, sample
from services.engine.sampling_params import SamplingParams


def test_penalties_arithmetic():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    # prompt [2, 1]; output [0, 0, 1]: 3 and 4 were never seen
    _penalize(x, p, [2, 1, 0, 0, 1], 2)
    want = [2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2, 3.0, 1.0]
    assert x.tolist() == pytest.approx(want)


def test_presence_and_frequency_read_only_the_output():
    x = torch.tensor([1.0, 1.0])
    _penalize(x, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), [0, 0, 1], 2)
    assert x.tolist() == [1.0, -3.0]


def test_a_row_without_history_is_not_penalized():
    logits = torch.tensor([[0.0, 5.0, 4.9]])
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sample(logits, [p], [0], [1], histories=[([1], 0)]).tokens == [2]
    assert sample(logits, [SamplingParams(temperature=0)], [0], [1], histories=[None]).tokens == [1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=True), "repetition_penalty"),
    ],
)
def test_bad_penalties_are_refused_by_name(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.create(**kwargs)
    assert e.value.field == field


BIASED, BIAS = 77, 10.0


def _reference(hf, prompt: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """Greedy decoding over transformers' full-sequence logits: the bias, then transformers'
    own repetition processor, then OpenAI's presence / frequency formula written out here."""
    from transformers import RepetitionPenaltyLogitsProcessor

    rep_proc = RepetitionPenaltyLogitsProcessor(rep)
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[:, -1]
        logits[0, BIASED] += BIAS
        logits = rep_proc(torch.tensor([ids]), logits)[0]
        for t in set(ids[len(prompt) :]):
            logits[t] -= freq * ids[len(prompt) :].count(t) + pres
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_penalized_greedy_tokens_equal_a_reference_over_transformers(tiny_model_dir, make_engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    eng = make_engine(num_kv_blocks=128)
    rng = random.Random(4)
    prompt = [rng.randrange(3, 256) for _ in range(12)]
    # the bias makes one token repeat in the plain output, so that each penalty has work to do
    biased = dict(max_tokens=16, temperature=0, ignore_eos=True, logit_bias=((BIASED, BIAS),))
    plain = eng.generate([prompt], SamplingParams(**biased))
    assert plain[0].count(BIASED) > 8
    for rep, freq, pres in [(3.0, 0.0, 0.0), (1.0, 2.0, 0.0), (1.0, 0.0, 2.0), (1.5, 1.0, -0.5)]:
        want = _reference(hf, prompt, 16, rep, freq, pres)
        params = SamplingParams(
            **biased,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        (got,) = eng.generate([prompt], params)
        assert got == want, (rep, freq, pres)
        assert got != plain[0]  # the penalties changed the output (the check can fail)
