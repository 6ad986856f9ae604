"""The packed GEMM of prompts and large batches (``services.engine.packed_gemm``): a bf16 copy
under fp32 activations, and the row invariance ``batch_invariant`` relies on."""

from __future__ import annotations

import pytest
import torch

from services.engine.linear import Linear
from services.engine.packed_gemm import BF16_INVARIANT_ROWS, PackedGemm
from services.engine.precision import (
    cpu_has_amx,
    cpu_has_native_bf16,
    resolve_dtype,
    resolve_matmul_dtype,
)
from services.engine.quant import QuantLinear, QuantWeight

NATIVE = pytest.mark.skipif(not cpu_has_native_bf16(), reason="no native bf16 on this CPU")


def _data(rows: int = 80, k: int = 96, n: int = 160) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NATIVE)])
@pytest.mark.parametrize("k", [96, 1536])  # 1,536: SmolLM2's down projection
def test_invariant_calls_round_each_row_as_it_rounds_alone(dtype, k):
    # a row alone takes oneDNN's matrix-vector path at long inputs (another rounding): an
    # invariant call of one row must round it as the GEMM does
    x, w = _data(k=k)
    bias = torch.randn(w.shape[0])
    gemm = PackedGemm(w, dtype)
    alone = torch.cat([gemm(x[i : i + 1], bias, invariant=True) for i in range(len(x))])
    for start, rows in [(0, 80), (3, 33), (7, 64), (40, 40), (1, BF16_INVARIANT_ROWS)]:
        got = gemm(x[start : start + rows], bias, invariant=True)
        assert got.dtype == torch.float32
        assert torch.equal(got, alone[start : start + rows]), (start, rows)
    ref = x @ w.T + bias
    tol = 1e-4 if dtype == torch.float32 else 0.05  # bf16 inputs: 8 mantissa bits
    torch.testing.assert_close(alone, ref, atol=tol, rtol=tol)


@pytest.mark.skipif(
    not cpu_has_amx(),
    reason="no AMX: oneDNN's AVX512-BF16 GEMM (a Zen 4 core, measured) rounds rows alike "
    "at any call size",
)
def test_bf16_calls_by_size_are_whole_and_may_round_differently():
    # the check that slicing is what makes bf16 invariant: a whole call of more rows than
    # BF16_INVARIANT_ROWS rounds some rows differently on oneDNN's AMX path
    x, w = _data(rows=256, k=576, n=512)
    gemm = PackedGemm(w, torch.bfloat16)
    whole = gemm(x, None, invariant=False)
    sliced = gemm(x, None, invariant=True)
    assert not torch.equal(whole, sliced)
    torch.testing.assert_close(whole, sliced, atol=0.05, rtol=0.05)


@NATIVE
def test_a_dense_linear_packed_in_bf16_keeps_no_fp32_copy():
    x, w = _data()
    lin = Linear(w, None, torch.bfloat16)
    assert lin.w_t is None and lin.nbytes == w.numel() * 2
    for rows in (1, 2, 5):  # below PACKED_MIN_ROWS too: the packed copy is the only one
        torch.testing.assert_close(lin(x[:rows]), x[:rows] @ w.T, atol=0.05, rtol=0.05)
    fp32 = Linear(w, None, torch.float32)
    assert fp32.w_t is not None and fp32.nbytes == w.numel() * 4


@NATIVE
def test_quantized_linear_packs_its_dequantized_weight_in_bf16():
    x, w = _data(rows=40, k=64)
    q = QuantWeight.from_float(w, "q4")
    lin = QuantLinear(q, None, torch.bfloat16)
    assert lin.packed is not None and lin.packed.dtype == torch.bfloat16
    ref = x @ q.dequantize().T
    torch.testing.assert_close(lin(x), ref, atol=0.05, rtol=0.05)  # 40 rows: the packed GEMM


def test_dtype_auto_is_fp32_activations_with_bf16_matmuls_where_native():
    assert resolve_dtype("auto", "cpu") == "float32"
    want = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_matmul_dtype("auto", "cpu") == want
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_matmul_dtype(name, "cpu") == resolve_dtype(name, "cpu") == name


@pytest.mark.parametrize("amx", [True, False])
def test_prompt_attention_runs_bf16_only_where_amx_runs_it(monkeypatch, amx):
    from services.engine import precision

    monkeypatch.setattr(precision, "cpu_has_amx", lambda: amx)
    bf16 = precision.prompt_attention_dtype(torch.bfloat16, "cpu")
    assert bf16 == (torch.bfloat16 if amx else torch.float32)
    assert precision.prompt_attention_dtype(torch.float32, "cpu") == torch.float32
    assert precision.prompt_attention_dtype(torch.bfloat16, "cuda") == torch.bfloat16


@NATIVE
def test_the_default_engine_s_prompt_attention_dtype_follows_the_host():
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine

    eng = Engine.from_path(None, EngineConfig(num_kv_blocks=64))
    attention = eng.backend.attention
    reference = getattr(attention, "reference", attention)
    assert reference.prompt_dtype == (torch.bfloat16 if cpu_has_amx() else None)


@NATIVE
def test_keep_returns_the_bf16_result_itself():
    """What the MLP feeds from gate_up into down on AMX hosts: the same values, not widened."""
    x, w = _data(rows=40)
    gemm = PackedGemm(w, torch.bfloat16)
    kept = gemm(x, None, invariant=False, keep=True)
    assert kept.dtype == torch.bfloat16
    assert torch.equal(kept, gemm(x, None, invariant=False).bfloat16())
    assert gemm(x, None, invariant=False).dtype == torch.float32
    lin = QuantLinear(QuantWeight.from_float(w, "q8"), None, torch.bfloat16)
    assert lin(x, keep=True).dtype == torch.bfloat16 and lin(x[:2], keep=True).dtype == x.dtype


@NATIVE
@pytest.mark.parametrize("quantized", [False, True])
def test_rows_handed_over_in_the_input_dtype_give_the_same_bits(quantized):
    """What a prompt's norms do (``LinearLayer.input_dtype``): rows already rounded to the
    packed GEMM's bf16 give exactly the result of fp32 rows, in the activations' fp32, the bias
    added as before; where a call would not round its input (the kernels' batch sizes, an fp32
    copy, roles) the layer says None, so nothing is rounded for it."""
    from services.engine.row_roles import RowRoles

    x, w = _data(rows=40)
    bias = torch.randn(w.shape[0])
    if quantized:
        q = QuantWeight.from_float(w, "q4")
        lin, fp32 = QuantLinear(q, bias, torch.bfloat16), QuantLinear(q, bias, torch.float32)
    else:
        lin, fp32 = Linear(w, bias, torch.bfloat16), Linear(w, bias, torch.float32)
    assert lin.input_dtype(40, None) == torch.bfloat16
    got = lin(x.bfloat16())
    assert got.dtype == torch.float32 and torch.equal(got, lin(x))
    assert torch.equal(lin(x.bfloat16(), keep=True), lin(x, keep=True))
    assert fp32.input_dtype(40, None) is None
    assert lin.input_dtype(40, RowRoles.of([False] * 40, "cpu")) is None
    if quantized:  # the kernels' batch sizes compute on the fp32 rows
        assert isinstance(lin, QuantLinear) and lin.input_dtype(lin.kernel_rows, None) is None
