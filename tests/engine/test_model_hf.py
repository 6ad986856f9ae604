"""Greedy tokens equal HF transformers' generate on the same fp32 weights, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.sampling_params import SamplingParams
from tests.fixtures import TINY_CONFIGS, hf_greedy

PROMPT_LENS = [1, 5, 17, 40]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_matches_transformers(name, tiny_model_dir, make_engine):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eng = make_engine(name, block_size=4, num_kv_blocks=128)
    rng = random.Random(1)
    for n in PROMPT_LENS:
        prompt = [rng.randrange(3, 256) for _ in range(n)]
        want = hf_greedy(hf, prompt, 24, eos=2)
        (got,) = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0))
        assert got == want, f"{name}, prompt length {n}: {got} != {want}"


def test_rope_llama3_frequencies_match_transformers(tiny_model_dir):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.engine.loader import load_model
    from services.engine.rope import inv_frequencies

    folder = tiny_model_dir("llama3-rope-scaled")
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(folder), "cpu")
    ours = inv_frequencies(load_model(folder).config)
    torch.testing.assert_close(ours, ref.float(), rtol=0, atol=0)
