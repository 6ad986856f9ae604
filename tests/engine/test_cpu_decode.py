"""``FusedDecode``: a whole pure-decode step in one C call equals the per-op path bit for bit
(tokens and log-probabilities), for every model variant, batch sizes up to and past its limit,
fp32, bf16 and int8 KV; and it is actually the path the engine takes."""

from __future__ import annotations

import random

import pytest

from services.engine.cpu_decode import MAX_BATCH, FusedDecode
from services.engine.cpu_kernels import library
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(library.load() is None, reason=str(library.load_error()))


def _run(eng, prompts, params):
    toks = {f"r{i}": [] for i in range(len(prompts))}
    lps = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    while eng.has_unfinished:
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
    return toks, lps


@pytest.mark.parametrize(
    "model,extra",
    [
        ("llama-gqa-tied", {}),
        ("qwen2-bias", {}),  # biases on q, k, v
        ("mistral-window", {}),  # sliding window: contexts pass it below
        ("llama-hd64", {"kv_cache_dtype": "int8"}),
        ("llama-hd64", {"kv_cache_dtype": "bfloat16"}),
    ],
)
@pytest.mark.parametrize("batch", [1, 3, MAX_BATCH + 3])
def test_fused_decode_equals_the_per_op_path(make_engine, model, extra, batch):
    cfg = dict(
        quantization="int4", attention_backend="cpu", dtype="float32", num_kv_blocks=256, **extra
    )
    fused, per_op = make_engine(model, **cfg), make_engine(model, **cfg)
    assert isinstance(fused.runner.fused, FusedDecode)
    per_op.runner.fused = None
    rows: list[int] = []
    run = fused.runner.fused.run

    def counted(input_ids, positions, meta):
        rows.append(input_ids.shape[0])
        return run(input_ids, positions, meta)

    fused.runner.fused.run = counted  # type: ignore[method-assign]
    rng = random.Random(batch)
    # >= 9 tokens: the prefill steps take the per-op path (SDPA), the decode steps the fused
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(9, 30))] for _ in range(batch)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    got, want = _run(fused, prompts, params), _run(per_op, prompts, params)
    assert got == want  # tokens and log-probabilities, exactly
    if batch <= MAX_BATCH:
        assert len(rows) >= 5  # pure decode steps of <= MAX_BATCH sequences took the fused path
    else:
        # steps of more rows keep the per-op path (the tail, as requests finish, may fuse)
        assert max(rows, default=0) <= MAX_BATCH and len(rows) < 9


def test_it_applies_only_to_quantized_fp32_cpu_engines(make_engine):
    assert make_engine(quantization="none").runner.fused is None  # dense linears
    assert make_engine(quantization="int8", attention_backend="torch").runner.fused is None
    assert make_engine(quantization="int8").runner.fused is not None


def test_speculation_through_the_fused_step_is_bit_lossless(make_engine, monkeypatch):
    """Verification steps (a few tokens per sequence) run fused, each token with the
    arithmetic of a plain decode step: identical tokens and log-probabilities, exactly."""
    from services.engine import scheduler as scheduler_module
    from tests.engine.test_speculative import _oracle

    cfg = dict(quantization="int4", attention_backend="cpu", dtype="float32", num_kv_blocks=256)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (9, 17)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    want = _run(make_engine(**cfg), prompts, params)
    spec = make_engine(speculative_tokens=3, **cfg)
    reference = {tuple(p): want[0][f"r{i}"] for i, p in enumerate(prompts)}
    monkeypatch.setattr(scheduler_module, "propose", _oracle(reference, 3))
    fused = spec.runner.fused
    widths: list[int] = []
    run = fused.run

    def seen(ids, positions, meta):
        widths.append(max(meta.query_lens))
        return run(ids, positions, meta)

    fused.run = seen  # type: ignore[method-assign]
    assert _run(spec, prompts, params) == want
    assert max(widths) > 1  # verification steps went through the fused path
    st = spec.stats()
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
