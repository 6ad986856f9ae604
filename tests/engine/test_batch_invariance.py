"""``batch_invariant``: a request's KV, log-probabilities and so its seeded tokens do not depend
on the requests it shares steps with (``services.engine.row_roles``). With kernels chosen by
batch size (``batch_invariant: false``), steps over ``kernel_rows`` rows (16 or 32, by the
kernels' SIMD path) run fp32 packed GEMMs and smaller ones the quantized kernels, so the same request rounds differently alone and in a batch; the
fault bench found seeded requests that then diverged, and resumed replays that disagreed."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvtransfer.outbox import Outbox
from services.config import load_config
from services.engine.cpu_backend import prompt_kernel_fits
from services.engine.engine import Engine, resolve_batch_invariant
from services.engine.precision import cpu_has_native_bf16
from services.engine.quant import kernel_rows
from services.engine.row_roles import RowRoles, by_role
from services.engine.sampling_params import SamplingParams

PROMPTS = [
    "Name a planet and say why.",
    "Count to five, slowly:",
    "The capital of France is",
    "Hello there, how are you",
    "Two plus two equals",
    "A short poem about rain:",
    "My favourite colour is",
    "Give me a word for cat.",
]
ROWS = kernel_rows(torch.float32)  # by size, steps over this many rows run the packed GEMM
MANY = ROWS + 4  # decode steps of more than ROWS rows


# (batch_invariant, dtype): "auto" on a CPU with native bf16 runs prompt rows through bf16
# packed GEMMs and bf16 prompt attention (services.engine.precision); elsewhere it is fp32
MODES = [
    pytest.param(True, "float32", id="invariant-fp32"),
    pytest.param(False, "float32", id="by-size-fp32"),
    pytest.param(
        True,
        "auto",
        id="invariant-bf16-matmuls",
        marks=pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16 on this CPU"),
    ),
]


def _engine(invariant: bool, role: str, dtype: str = "float32") -> Engine:
    cfg = load_config(overrides={"batch_invariant": invariant, "dtype": dtype}, environ={})
    return Engine.from_path(None, cfg.engine_config(cfg.prefill, role))  # type: ignore[arg-type]


def _prompt_kv(
    engine: Engine, batch: list[int], prompts: list[list[int]]
) -> dict[int, torch.Tensor]:
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    box = Outbox(engine.fingerprint, contextlib.nullcontext)
    entries = {i: box.open(f"r{i}", len(prompts[i]), False) for i in batch}
    for i in batch:
        engine.add_request(f"r{i}", prompts[i], sp, kv_sink=entries[i])
    while engine.has_unfinished:
        engine.step()
    # the prompt's positions (a block's tail past them is stale memory, never read)
    out = {
        i: box.get(f"r{i}", e.secret).blocks.flatten(2, 3)[:, :, : len(prompts[i])].clone()
        for i, e in entries.items()
    }
    box.close()
    return out


@pytest.mark.parametrize(("invariant", "dtype"), MODES)
def test_a_prompt_s_kv_is_the_same_alone_and_in_a_batch_only_when_batch_invariant(invariant, dtype):
    engine = _engine(invariant, "prefill", dtype)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert all(len(p) < 16 for p in prompts)  # under one block: no prefix-cache hit between runs
    alone: dict[int, torch.Tensor] = {}
    for i in range(len(prompts)):
        alone |= _prompt_kv(engine, [i], prompts)  # under 16 rows
    assert sum(map(len, prompts)) > ROWS
    batched = _prompt_kv(engine, list(range(len(prompts))), prompts)  # over ROWS rows
    same = [torch.equal(alone[i], batched[i]) for i in range(len(prompts))]
    assert all(same) if invariant else not any(same)


@pytest.mark.parametrize(("invariant", "dtype"), MODES)
def test_a_prefix_cache_hit_rounds_the_rest_of_the_prompt_as_a_miss_only_when_batch_invariant(
    invariant, dtype
):
    engine = _engine(invariant, "prefill", dtype)
    base = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    full = base + engine.tokenizer.encode(" And then")
    # a miss runs over ROWS rows; a 2-block hit leaves under 16
    assert len(full) > ROWS and len(base) >= 32 and len(full) - 32 < 16
    miss = _prompt_kv(engine, [0], [full])[0]
    hit = _prompt_kv(engine, [0], [full])[0]  # its first two blocks from the cache
    assert engine.stats().prefix_hit_tokens == 32
    assert torch.equal(hit, miss) == invariant


@pytest.mark.skipif(not prompt_kernel_fits(), reason="the prompt kernel runs on AVX-512")
@pytest.mark.parametrize(("invariant", "dtype"), [m for m in MODES if m.values[0]])
@pytest.mark.parametrize("rest", [1, 5, 8, 9])
def test_a_prompt_s_short_rest_after_a_prefix_hit_rounds_as_in_the_whole_prompt(
    invariant, dtype, rest
):
    """A prompt row attends through the prompt kernel whatever its span's length: the few
    prompt tokens a prefix-cache hit leaves (a span as short as a decode's or a speculative
    verification's, which take the decode kernel) round as they do inside the whole prompt."""
    engine = _engine(invariant, "prefill", dtype)
    base = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:32]
    full = base + list(range(1000, 1000 + rest))
    miss = _prompt_kv(engine, [0], [full])[0]
    hit = _prompt_kv(engine, [0], [full])[0]  # its first two blocks from the cache
    assert engine.stats().prefix_hit_tokens == 32
    assert torch.equal(hit, miss)


def _generate(
    engine: Engine, requests: dict[str, tuple[list[int], int]], late: frozenset[str] = frozenset()
):
    """Runs requests (id -> (prompt, seed)) to the end; those in ``late`` are added after the
    others' first decode step, so their prompts share steps with decodes. Returns each
    request's (tokens, logprobs)."""
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(rid: str) -> None:
        prompt, seed = requests[rid]
        sp = SamplingParams(
            max_tokens=8, temperature=0.9, seed=seed, logprobs=True, ignore_eos=True
        )
        engine.add_request(rid, prompt, sp)
        out[rid] = ([], [])

    for rid in requests.keys() - late:
        add(rid)
    steps = 0
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.new_logprobs or [])
        steps += 1
        if steps == 2:
            for rid in late:
                add(rid)
    return out


@pytest.mark.parametrize(("invariant", "dtype"), MODES)
def test_decodes_and_mixed_steps_are_the_same_alone_and_batched_only_when_batch_invariant(
    invariant, dtype
):
    engine = _engine(invariant, "both", dtype)
    tok = engine.tokenizer
    target = {"t": (tok.encode("Write one line about the sea."), 7)}
    alone = _generate(engine, target)["t"]
    # the target among MANY decodes (steps over ROWS rows), its prompt arriving while they decode
    others = {
        f"o{i}": (tok.encode(f"Say something about the number {i}."), 100 + i) for i in range(MANY)
    }
    batched = _generate(engine, others | target, late={"t"})["t"]
    assert len(alone[1]) == len(batched[1]) == 8
    if invariant:
        assert batched == alone  # tokens and logprobs, bit for bit
    else:
        assert batched[1] != alone[1]  # the same request, rounded differently


def test_by_role_runs_each_row_by_its_role_in_order():
    x = torch.arange(12.0).reshape(6, 2)
    roles = RowRoles.of([False, True, True, False, True, False], "cpu")
    y = by_role(x, roles, lambda r: r * 10, lambda r: -r)
    assert torch.equal(y[[0, 3, 5]], x[[0, 3, 5]] * 10) and torch.equal(y[[1, 2, 4]], -x[[1, 2, 4]])
    assert RowRoles.of([True, True], "cpu").split is None  # one role: no gathering
    assert torch.equal(
        by_role(x, RowRoles.of([False] * 6, "cpu"), lambda r: r * 10, lambda r: -r), x * 10
    )


def test_batch_invariant_is_on_with_the_cpu_backend_and_refused_by_name_elsewhere():
    assert resolve_batch_invariant("auto", "cpu") is True
    assert resolve_batch_invariant("auto", "cpu", torch.bfloat16) is False  # AMX: throughput
    assert resolve_batch_invariant(True, "cpu", torch.bfloat16) is True
    assert resolve_batch_invariant("auto", "triton") is False
    assert resolve_batch_invariant(False, "cpu") is False
    with pytest.raises(ValueError, match="batch_invariant is implemented by the 'cpu'"):
        resolve_batch_invariant(True, "torch")
