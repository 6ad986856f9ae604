"""End-to-end checks on the real embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1)."""

from __future__ import annotations

import pytest

from services.engine.sampling_params import SamplingParams
from tests.fixtures import hf_greedy

pytestmark = pytest.mark.slow

RAW_PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    ", "Paris is the capital of"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a color."},
    ],
]


def test_greedy_matches_transformers_raw_and_chat(smollm_engine, smollm_hf):
    hf_tok, hf = smollm_hf
    tok = smollm_engine.tokenizer
    prompts = [tok.encode(p) for p in RAW_PROMPTS] + [tok.encode_chat(m) for m in CHATS]
    for text, ids in zip(RAW_PROMPTS, prompts):
        assert ids == hf_tok.encode(text)
    for m, ids in zip(CHATS, prompts[len(RAW_PROMPTS) :]):
        assert ids == hf_tok.apply_chat_template(
            m, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    params = SamplingParams(max_tokens=24, temperature=0)
    got = smollm_engine.generate(prompts, params)  # batched together
    for ids, ours in zip(prompts, got):
        assert ours == hf_greedy(hf, ids, 24, eos=2)
    assert tok.decode(got[len(RAW_PROMPTS)]).startswith("The capital of France is Paris")
    smollm_engine.check_integrity()


def test_gguf_cache_is_an_hf_folder_and_reloads(smollm_engine):
    from services.engine.loader import default_model_path, gguf_cache_folder, load_model

    folder = gguf_cache_folder(default_model_path())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    again = load_model(None)
    assert again.folder == folder and again.config == smollm_engine.model_config
    assert again.model_id == "SmolLM2-135M-Instruct"
