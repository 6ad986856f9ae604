"""``batch_invariant``: a prompt's KV (and so a seeded request's tokens) does not depend on the
prompts it is prefilled with. By default batches over 16 rows run fp32 packed GEMMs and
smaller ones the quantized kernels, so a prompt prefilled alone and the same prompt in a
batch are rounded differently; the fault bench found seeded requests that then diverged."""

from __future__ import annotations

import pytest
import torch

from services.config import load_config
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams

PROMPTS = [
    "Name a planet and say why.",
    "Count to five, slowly:",
    "The capital of France is",
    "Hello there, how are you",
]


def _kv(engine: Engine, batch: list[int], prompts: list[list[int]]) -> dict[int, torch.Tensor]:
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in batch:
        engine.add_request(f"r{i}", prompts[i], sp)
    while engine.has_unfinished:
        engine.step()
    # the prompt's positions (a block's tail past them is stale memory, never read)
    out = {
        i: engine.export_kv(f"r{i}").blocks.flatten(2, 3)[:, :, : len(prompts[i])].clone()
        for i in batch
    }
    for i in batch:
        engine.release_kv(f"r{i}")
    return out


@pytest.mark.parametrize("invariant", [True, False])
def test_a_prompt_s_kv_is_the_same_alone_and_in_a_batch_only_when_batch_invariant(invariant):
    cfg = load_config(overrides={"batch_invariant": invariant}, environ={})
    engine = Engine.from_path(None, cfg.engine_config(cfg.prefill, "prefill"))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert all(len(p) < 16 for p in prompts)  # under one block: no prefix-cache hit between runs
    alone: dict[int, torch.Tensor] = {}
    for i in range(len(prompts)):
        alone |= _kv(engine, [i], prompts)  # under 16 rows: the quantized kernels
    batched = _kv(engine, list(range(len(prompts))), prompts)  # over 16 rows
    same = [torch.equal(alone[i], batched[i]) for i in range(len(prompts))]
    assert all(same) if invariant else not any(same)
