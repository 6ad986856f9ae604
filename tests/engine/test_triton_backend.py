"""The Triton backend in the engine gives the tokens of transformers (fp32), also through the
padded decode-graph path. Without CUDA it runs under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.cuda_graphs import DecodeGraphs
from services.engine.sampling_params import SamplingParams
from tests.fixtures import hf_greedy

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias", "mistral-window"])
def test_triton_greedy_matches_transformers(name, tiny_model_dir, make_engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(name), dtype=torch.float32).eval()
    # a small step budget: the 40-token prompt is prefilled in chunks over its cached part
    eng = make_engine(
        name,
        attention_backend="triton",
        device=DEVICE,
        max_num_batched_tokens=16,
        num_kv_blocks=96,
    )
    assert eng.backend.name == "triton"
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 6, 40)]
    got = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, g in zip(prompts, got):
        assert g == hf_greedy(hf, p, 12), f"{name}, prompt length {len(p)}"


def test_triton_padded_decode_buckets_match_eager(make_engine):
    """The exact launches a CUDA graph captures (grids sized by max_model_len, padded rows on
    the scratch block), run eagerly: the same tokens as unpadded eager steps."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = make_engine(attention_backend="triton", device=DEVICE).generate(prompts, params)
    eng = make_engine(attention_backend="triton", device=DEVICE, cuda_graphs=False)
    eng.runner.graphs = DecodeGraphs(
        eng.model,
        eng.cache,
        eng.step_state,
        eng.backend,
        max_batch=4,
        capture=DEVICE == "cuda",
    )
    assert eng.generate(prompts, params) == want
