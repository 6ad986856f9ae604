"""The ``cpu`` backend's C ops against the torch reference ops on random inputs (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.attention import SeqSpan, TorchAttention, build_metadata
from services.engine.config import ModelConfig
from services.engine.cpu_backend import prompt_kernel_fits
from services.engine.cpu_kernels import library
from services.engine.kv_cache import KVCache
from services.engine.layer_ops import TorchOps
from services.engine.rope import Rotary
from tests.fixtures import narrower_kernel_builds

pytestmark = pytest.mark.skipif(library.load() is None, reason=str(library.load_error()))
# the native build's prompt kernel computes over a bf16 cache with bf16 dot products here
BF16_PRODUCTS = "avx512_bf16" in library.cpu_flags().split()
# ... whose error against float64 (unit-normal q, k, v; queries and weights rounded to bf16):
# measured 1.5e-3 to 6.1e-3, where SDPA's bf16 kernel on the same values is 1.7e-3 to 1.2e-2
BF16_PRODUCTS_TOL = 8e-3


@pytest.fixture(scope="module")
def cpu():
    from services.engine.cpu_backend import CpuAttention, CpuOps

    return CpuAttention(), CpuOps()


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(cpu, with_residual):
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(5, 67, generator=g), torch.randn(5, 67, generator=g), torch.randn(67)
    res = r if with_residual else None
    got = cpu[1].add_rms_norm(x, res, w, 1e-5)
    want = TorchOps().add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the sum: same rounding
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_add_rms_norm_takes_and_gives_bf16_rows_with_the_same_bits_on_every_simd_path():
    """A packed bf16 GEMM's kept result in (widened exactly) and the next GEMM's bf16 input out
    (rounded once, to nearest even): bit-equal to converting around the fp32 norm, which is
    what a prompt's linears did before; and every build (AVX-512's 16-lane loop, AVX2's 8,
    portable C) sums the squares in the same order. 1,000 columns: past the 16-lane loop's
    last full vector, and a tail under 8."""
    from services.engine.cpu_backend import CpuOps

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1003, generator=g) * 4
    x[1, 7] = float("inf")  # a row whose output is NaN: stays NaN in bf16
    res, w = torch.randn(6, 1003, generator=g), torch.randn(1003, generator=g)
    xb = x.bfloat16()
    results = {}
    for name, lib in {"native": library.load(), **narrower_kernel_builds()}.items():
        ops = CpuOps()
        ops.lib = lib
        out, summed = ops.add_rms_norm(xb, res, w, 1e-5, torch.bfloat16)
        ref, ref_sum = ops.add_rms_norm(xb.float(), res, w, 1e-5)
        assert out.dtype == torch.bfloat16 and summed.dtype == torch.float32
        assert torch.equal(summed, ref_sum), name
        assert torch.equal(out.view(torch.int16)[0], ref.bfloat16().view(torch.int16)[0]), name
        torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0, equal_nan=True)
        first, _ = ops.add_rms_norm(x, None, w, 1e-5, torch.bfloat16)  # no residual, fp32 in
        torch.testing.assert_close(
            first, ops.add_rms_norm(x, None, w, 1e-5)[0].bfloat16(), rtol=0, atol=0, equal_nan=True
        )
        results[name] = ops.add_rms_norm(x, res, w, 1e-5), (out, summed)
    for name, (fp32, bf16) in results.items():
        for got, want in zip(fp32 + bf16, results["native"][0] + results["native"][1]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)
    # the torch reference: bf16 x promoted to the residual's fp32, the normed rows rounded once
    out, summed = TorchOps().add_rms_norm(xb, res, w, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(summed, results["native"][1][1])
    torch.testing.assert_close(out[2:], results["native"][1][0][2:], rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("kv_dtype,dim", [("float32", 16), ("int8", 64), ("bfloat16", 16)])
def test_rope_and_cache(cpu, kv_dtype, dim):
    """Same bytes in the cache: for int8 the C quantizer rounds exactly as kv_quant does, for
    bf16 the C rounding exactly as torch's (to nearest even)."""
    cfg = ModelConfig("llama", 100, 6 * dim, 64, 1, 6, 2, dim, 128)
    rot = Rotary(cfg, 128, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, (6 + 4) * dim, generator=g)  # a fused projection: strided views
    qkv[0, 6 * dim + 2 * dim : 6 * dim + 2 * dim + 32] = 0  # an all-zero int8 group
    positions = torch.tensor([0, 5, 77, 127])
    slots = torch.tensor([3, -1, 40, 9])  # -1: padding, not written
    outs = []
    for ops in (TorchOps(), cpu[1]):
        cache = KVCache(1, 8, 8, 2, dim, torch.float32, "cpu", kv_dtype)
        q, k, v = qkv.clone().split((6 * dim, 2 * dim, 2 * dim), dim=-1)
        q, k, v = q.view(4, 6, dim), k.view(4, 2, dim), v.view(4, 2, dim)
        keep = slots >= 0  # the torch reference has no padding rule: give it the real rows
        if isinstance(ops, TorchOps):
            qo, ko = ops.rope_and_cache(
                q, k, v, ops.rope_tables(positions, rot), cache, 0, slots.clamp(min=0)
            )
            kc, vc = cache.flat(0)
            kc[:, 0] = 0  # undo the padding row's write to slot 0
            vc[:, 0] = 0
        else:
            qo, ko = ops.rope_and_cache(q, k, v, ops.rope_tables(positions, rot), cache, 0, slots)
        outs.append((qo.clone(), ko.clone(), cache.k[0].clone(), cache.v[0].clone()))
        assert keep.sum() == 3
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_silu_and_mul(cpu):
    gu = torch.randn(3, 2 * 50, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        cpu[1].silu_and_mul(gu), TorchOps().silu_and_mul(gu), rtol=1e-6, atol=1e-6
    )


def test_silu_and_mul_on_bf16_rounds_the_fp32_result_once(cpu):
    """The bf16 rows of the MLP on AMX hosts: exactly the fp32 kernel's result on the widened
    inputs, rounded to nearest even (vector lanes and the scalar tail alike: 50 = 3 x 16 + 2);
    extreme gates and a NaN too."""
    gu = (torch.randn(3, 2 * 50, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    gu[0, :3] = torch.tensor([-200.0, 200.0, float("nan")]).bfloat16()
    got = cpu[1].silu_and_mul(gu)
    want = cpu[1].silu_and_mul(gu.float()).bfloat16()  # torch rounds to nearest even
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[~want.isnan()], want[~want.isnan()]) and got[0, 2].isnan()


def _decode_case(block_size: int, kv_dtype: str, dim: int, kv_heads: int, lens: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """A cache of random rows and one single-token span per length, in shuffled blocks."""
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    n_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = KVCache(1, n_blocks, block_size, kv_heads, dim, torch.float32, "cpu", kv_dtype)
    every = torch.arange(n_blocks * block_size)
    cache.write(
        0, torch.randn(len(every), kv_heads, dim), torch.randn(len(every), kv_heads, dim), every
    )
    free = list(range(n_blocks))
    rng.shuffle(free)
    spans = []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        spans.append(SeqSpan(n - 1, 1, table))
    return cache, spans


def _attend(att, q, cache, spans, block_size, window):  # type: ignore[no-untyped-def]
    meta = build_metadata(spans, block_size, "cpu", window)
    att.prepare(meta)
    return att.forward(q, cache, 0, meta)


@pytest.mark.parametrize(
    "kv_dtype,dim", [("float32", 16), ("int8", 64), ("float32", 64), ("bfloat16", 64)]
)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_attention_matches_reference(cpu, window, block_size, kv_dtype, dim):
    cache, spans = _decode_case(block_size, kv_dtype, dim, 2, (1, 5, 16, 17, 33, 130))
    q = torch.randn(len(spans), 6, dim)
    want = _attend(TorchAttention(), q, cache, spans, block_size, window)
    torch.testing.assert_close(
        _attend(cpu[0], q, cache, spans, block_size, window), want, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "kv_dtype,dim,heads,kv_heads",
    [("float32", 64, 9, 3), ("int8", 64, 9, 3), ("float32", 128, 8, 2), ("float32", 32, 12, 1),
     ("float32", 48, 4, 2), ("float32", 24, 4, 2), ("bfloat16", 64, 9, 3),
     ("bfloat16", 128, 8, 2), ("bfloat16", 24, 4, 2)],
)  # fmt: skip
def test_decode_attention_matches_reference_on_every_simd_path(kv_dtype, dim, heads, kv_heads):
    """Every build (this CPU's: 16 lanes where it has AVX-512; AVX2; portable C) and head
    grouping (3, 4 and 12 query heads per KV head: 12 is past the 16-lane path's limit; 24
    dims: not a multiple of 16) against the torch reference, contexts across 16-key blocks."""
    from services.engine.cpu_backend import CpuAttention

    cache, spans = _decode_case(16, kv_dtype, dim, kv_heads, (1, 15, 16, 31, 33, 257))
    q = torch.randn(len(spans), heads, dim)
    want = _attend(TorchAttention(), q, cache, spans, 16, None)
    libs = {"native": library.load(), **narrower_kernel_builds()}
    for name, lib in libs.items():
        att = CpuAttention()
        att.lib = lib
        got = _attend(att, q, cache, spans, 16, None)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def _prompt_case(block_size: int, dim: int, ctx: int, seed: int = 0, kv_dtype: str = "float32"):  # type: ignore[no-untyped-def]
    """A cache holding one sequence of ``ctx`` positions in shuffled blocks: (cache, table)."""
    torch.manual_seed(seed)
    blocks = -(-ctx // block_size) + 3
    cache = KVCache(1, blocks, block_size, 3, dim, torch.float32, "cpu", kv_dtype)
    every = torch.arange(blocks * block_size)
    cache.write(0, torch.randn(len(every), 3, dim), torch.randn(len(every), 3, dim), every)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    return cache, table[: -(-ctx // block_size)].tolist()


def _run_prompt(lib, cache, table, q, ctx, window=0):  # type: ignore[no-untyped-def]
    n, heads, dim = q.shape
    out = torch.empty_like(q)
    scratch = torch.empty(lib.pdserve_prompt_attention_scratch(ctx, heads, 3, dim))
    t = torch.tensor(table, dtype=torch.int32)
    kc, vc = cache.k[0], cache.v[0]
    lib.pdserve_prompt_attention(
        q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[1] * kc.shape[2], t.data_ptr(), ctx,
        n, heads, 3, dim, cache.block_size, window, dim**-0.5, out.data_ptr(), scratch.data_ptr(),
        cache.format_code,
    )  # fmt: skip
    return out


def _sdpa64(cache, table, q, ctx, window=0):  # type: ignore[no-untyped-def]
    """Causal attention of the span's rows in float64 over the cache's values (the rows are
    the last n of ctx)."""
    n = q.shape[0]
    bs = cache.block_size
    slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).flatten()[:ctx]
    k, v = (t.double() for t in cache.gather(0, slots))
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k[None], v[None], attn_mask=mask, enable_gqa=True
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize(
    "ctx,n,window,block_size,dim",
    [(37, 37, 0, 16, 64), (300, 300, 0, 16, 64), (333, 41, 0, 4, 64), (300, 300, 100, 16, 64),
     (130, 20, 9, 1, 64), (200, 200, 0, 16, 32), (70, 70, 0, 8, 40)],
)  # fmt: skip
def test_prompt_attention_matches_float64_on_every_simd_path(ctx, n, window, block_size, dim):
    """The prompt kernel on this CPU's build and on the narrower builds (AVX2, portable C):
    causal (and windowed) attention of a span after a cached prefix, read through a shuffled
    block table, within fp32 rounding of float64."""
    cache, table = _prompt_case(block_size, dim, ctx)
    q = torch.randn(n, 9, dim)
    want = _sdpa64(cache, table, q, ctx, window)
    libs = {"native": library.load()}
    if ctx == 300 and window == 0:  # one case is enough to check the other builds
        libs.update(narrower_kernel_builds())
    for name, lib in libs.items():
        got = _run_prompt(lib, cache, table, q, ctx, window)
        err = float((got.double() - want).abs().max())
        assert err < 5e-6, (name, err)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize(
    "ctx,n,window,dim", [(150, 100, 0, 64), (333, 41, 0, 64), (90, 90, 20, 32)]
)
def test_prompt_attention_reads_bf16_and_int8_caches_on_every_simd_path(
    kv_dtype, ctx, n, window, dim
):
    """Rows of a bf16 or int8 cache widened to fp32 as they are gathered: the same attention
    as over those values in float64, on every build; over a bf16 cache on an AVX512-BF16 CPU
    the native build's bf16 dot products, within their stated tolerance."""
    cache, table = _prompt_case(16, dim, ctx, kv_dtype=kv_dtype)
    q = torch.randn(n, 9, dim)
    want = _sdpa64(cache, table, q, ctx, window)
    for name, lib in {"native": library.load(), **narrower_kernel_builds()}.items():
        err = float((_run_prompt(lib, cache, table, q, ctx, window).double() - want).abs().max())
        products = name == "native" and kv_dtype == "bfloat16" and BF16_PRODUCTS
        assert err < (BF16_PRODUCTS_TOL if products else 5e-6), (name, err)
        if products:
            assert err > 1e-5, "the bf16 products were not used"


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_prompt_attention_keeps_each_rows_softmax_to_its_own_scores(kv_dtype):
    """Neighbouring query rows whose scores differ by far more than exp's range (|score| up
    to about 0.01 against about 150, alternating, and rows that see only a few keys): each
    row's running max, correction and sum must be its own (a row shifted by a neighbour's max
    would overflow to inf or underflow to a zero sum). Queries exact in bf16 after the 1/8
    scale, so the bf16 build's only rounding is its weights'; in fp32, scores near 150 carry
    about 1e-5 of absolute rounding into exp, hence 1e-4."""
    lib = library.load()
    ctx, n = 150, 45
    cache, table = _prompt_case(16, 64, ctx, seed=5, kv_dtype=kv_dtype)
    scale = torch.tensor([1e-3 if i % 2 else 50.0 for i in range(n)])[:, None, None]
    q = (torch.randn(n, 9, 64) * scale).bfloat16().float()
    want = _sdpa64(cache, table, q, ctx, 0)
    got = _run_prompt(lib, cache, table, q, ctx)
    assert torch.isfinite(got).all()
    tol = BF16_PRODUCTS_TOL if kv_dtype == "bfloat16" and BF16_PRODUCTS else 1e-4
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_prompt_attention_gives_a_row_the_same_bits_however_the_prompt_is_chunked(kv_dtype):
    """Key blocks start at position 0 whatever the span: a prompt in one span, or as a prefix
    then the rest (chunked prefill, a prefix-cache hit), gives each row the same bits."""
    lib = library.load()
    cache, table = _prompt_case(16, 64, 200, seed=3, kv_dtype=kv_dtype)
    q = torch.randn(200, 9, 64)
    whole = _run_prompt(lib, cache, table, q, 200)
    for cut in (1, 64, 77, 199):
        head = _run_prompt(lib, cache, table, q[:cut].contiguous(), cut)
        tail = _run_prompt(lib, cache, table, q[cut:].contiguous(), 200)
        assert torch.equal(torch.cat([head, tail]), whole), cut


@pytest.mark.skipif(not prompt_kernel_fits(), reason="the prompt kernel runs on AVX-512")
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_a_mixed_step_attends_prompts_by_kernel_and_short_spans_by_the_decode_kernel(cpu, kv_dtype):
    """A step of a long prompt span, a decode row, a 3-token verification span and a second
    prompt after a cached prefix: the cpu backend plans the prompt kernel, and every row
    matches the torch reference."""
    from services.engine.cpu_backend import _SpanPlan

    att = cpu[0]
    assert att.prompt_kernel
    torch.manual_seed(5)
    cache = KVCache(1, 64, 16, 3, 64, torch.float32, "cpu", kv_dtype)
    every = torch.arange(64 * 16)
    cache.write(0, torch.randn(len(every), 3, 64), torch.randn(len(every), 3, 64), every)
    spans = [SeqSpan(0, 40, [0, 1, 2]), SeqSpan(20, 1, [3, 4]), SeqSpan(50, 3, [5, 6, 7, 8]),
             SeqSpan(64, 30, [9, 10, 11, 12, 13, 14])]  # fmt: skip
    q = torch.randn(40 + 1 + 3 + 30, 9, 64)
    outs = []
    for a in (TorchAttention(), att):
        meta = build_metadata(spans, 16, "cpu", None)
        a.prepare(meta)
        outs.append(a.forward(q, cache, 0, meta))
    assert isinstance(meta.plan, _SpanPlan) and len(meta.plan.spans) == 2
    tol = BF16_PRODUCTS_TOL if kv_dtype == "bfloat16" and BF16_PRODUCTS else 1e-5
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    short = torch.arange(40, 44)  # the decode row and the verification span: fp32 products
    torch.testing.assert_close(outs[1][short], outs[0][short], rtol=1e-5, atol=1e-5)
