"""Triton kernels equal plain torch references on random inputs.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (set before the kernel
modules are imported: Triton reads it when ``@triton.jit`` runs). Tolerances: fp32 1e-4
(sums run in another order than torch's); bf16 2e-2 against an fp32 reference over the same
bf16-rounded inputs (bf16 has 8 mantissa bits: one rounding is ~4e-3 relative).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from services.engine.config import ModelConfig
from services.engine.kernels.activation import silu_and_mul
from services.engine.kernels.norm import fused_add_rms_norm
from services.engine.kernels.paged_decode import paged_decode_attention
from services.engine.kernels.paged_prefill import paged_prefill_attention
from services.engine.kernels.rope_cache import rope_and_cache_kv
from services.engine.kv_cache import KVCache
from services.engine.model import rms_norm
from services.engine.rope import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
NAN = float("nan")


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def _paged_context(contexts, kv_heads, head_dim, block_size, dtype, seed):
    """Random K/V per sequence written through shuffled block tables into a cache whose other
    slots, and the block that pads the tables, hold NaN: a read outside a context poisons the
    output. Returns (cache, block_tables [S, max_blocks] int32, keys, values)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in contexts) + 2
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, DEVICE)
    cache.k[0].fill_(NAN)
    cache.v[0].fill_(NAN)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poison = free.pop()
    tables, keys, values = [], [], []
    for n in contexts:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size
        cache.write(0, k.to(DEVICE), v.to(DEVICE), (slots + pos % block_size).to(DEVICE))
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables) + 1  # every row ends in padding
    rows = [t + [poison] * (width - len(t)) for t in tables]
    return cache, torch.tensor(rows, dtype=torch.int32, device=DEVICE), keys, values


def _dense(q, k, v, start, scale, window):
    """q: [n, H, D] at positions start..start+n-1; k, v: [ctx, KVH, D] -> fp32 [n, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(rep, dim=1)
    v = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), k) * scale
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), v)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window", "partition", "dtype"),
    [
        (6, 2, 16, 4, None, 16, torch.float32),  # GQA, split-K: 40 = 16 + 16 + 8
        (6, 2, 24, 16, 7, 16, torch.float32),  # D not a power of two; window skips partitions
        (4, 4, 16, 1, None, 512, torch.float32),  # MHA, block_size 1, single partition
        (6, 2, 24, 4, 20, 512, torch.float32),  # single partition with a window
        (6, 2, 16, 4, None, 16, torch.bfloat16),
    ],
)
def test_decode_matches_dense(heads, kv_heads, head_dim, block_size, window, partition, dtype):
    lens = [1, 5, 16, 17, 40]
    cache, tables, keys, values = _paged_context(lens, kv_heads, head_dim, block_size, dtype, 1)
    gen = torch.Generator().manual_seed(7)
    # q is strided in tokens and heads: only its last dim has unit stride
    q = torch.randn(len(lens), heads + 2, head_dim + 3, generator=gen).to(dtype)[:, 1:-1, :head_dim]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q.to(DEVICE), cache.k[0], cache.v[0], tables, seq_lens, scale, window, partition
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(lens):
        _close(
            out[i : i + 1], _dense(q[i : i + 1], keys[i], values[i], n - 1, scale, window), dtype
        )


def test_decode_grid_sized_for_max_model_len():
    # CUDA graphs size the grid once from max_model_len: partitions past a context exit early,
    # and a padding row (seq_len 0) yields zeros rather than NaN
    lens = [33, 0, 2]
    cache, tables, keys, values = _paged_context([33, 1, 2], 2, 16, 4, torch.float32, 2)
    q = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(8))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        q.to(DEVICE),
        cache.k[0],
        cache.v[0],
        tables,
        seq_lens,
        0.25,
        partition_size=16,
        max_seq_len=96,
    )
    _close(out[0:1], _dense(q[0:1], keys[0], values[0], 32, 0.25, None), torch.float32)
    assert torch.equal(out[1].cpu(), torch.zeros(6, 16))
    _close(out[2:3], _dense(q[2:3], keys[2], values[2], 1, 0.25, None), torch.float32)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "window", "dtype"),
    [
        (6, 2, 16, 4, None, torch.float32),
        (6, 2, 24, 16, 5, torch.float32),
        (4, 4, 16, 4, 3, torch.float32),
        (6, 2, 16, 16, None, torch.bfloat16),
    ],
)
def test_prefill_mixed_batch_matches_dense(heads, kv_heads, head_dim, block_size, window, dtype):
    # (cached prefix, new tokens): decodes, fresh prompts, prompts over a cached prefix; (50, 30)
    # spans several key tiles, so with a window some rows see a first tile wholly masked
    shapes = [(0, 1), (9, 1), (0, 7), (0, 23), (12, 5), (40, 19), (17, 1), (50, 30)]
    contexts = [c + n for c, n in shapes]
    cache, tables, keys, values = _paged_context(contexts, kv_heads, head_dim, block_size, dtype, 3)
    q_lens = torch.tensor([n for _, n in shapes])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(int(q_lens.sum()), heads + 1, head_dim + 3, generator=gen).to(dtype)
    q = q[:, 1:, :head_dim]  # strided in tokens and heads
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q.to(DEVICE),
        cache.k[0],
        cache.v[0],
        tables,
        query_start_loc.to(device=DEVICE, dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        int(q_lens.max()),
        scale,
        window,
    )
    assert out.dtype == dtype and out.shape == q.shape
    for s, (cached, _) in enumerate(shapes):
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        _close(out[a:b], _dense(q[a:b], keys[s], values[s], cached, scale, window), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_attention_at_model_shapes_on_gpu(window):
    # Llama-8B-like heads, bf16, contexts over several 512-token partitions: 20-60 s under the
    # interpreter, so the CPU runs cover the same paths at toy sizes
    heads, kv_heads, head_dim, scale = 32, 8, 128, 128**-0.5
    shapes = [(0, 300), (1000, 200), (1500, 1), (0, 1), (700, 1)]
    contexts = [c + n for c, n in shapes]
    cache, tables, keys, values = _paged_context(
        contexts, kv_heads, head_dim, 16, torch.bfloat16, 10
    )
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(n for _, n in shapes), heads, head_dim, generator=gen).bfloat16()
    q_lens = torch.tensor([n for _, n in shapes])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(
        q.to(DEVICE),
        cache.k[0],
        cache.v[0],
        tables,
        query_start_loc.to(device=DEVICE, dtype=torch.int32),
        seq_lens,
        300,
        scale,
        window,
    )
    for s, (cached, _) in enumerate(shapes):
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        expected = _dense(q[a:b], keys[s], values[s], cached, scale, window)
        _close(out[a:b], expected, torch.bfloat16)
    last = query_start_loc[1:] - 1  # each sequence's last token, as a decode
    out = paged_decode_attention(
        q[last].to(DEVICE), cache.k[0], cache.v[0], tables, seq_lens, scale, window
    )
    for s, n in enumerate(contexts):
        expected = _dense(q[last[s] : last[s] + 1], keys[s], values[s], n - 1, scale, window)
        _close(out[s : s + 1], expected, torch.bfloat16)


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    # the grid is fixed by max_seq_len at capture; each replay reads new seq_lens on the device
    lens = [700, 1, 1500]
    cache, tables, keys, values = _paged_context([1500] * 3, 8, 128, 16, torch.bfloat16, 12)
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(3, 32, 128, generator=gen).bfloat16().to(DEVICE)
    seq_lens = torch.ones(3, dtype=torch.int32, device=DEVICE)
    args = (q, cache.k[0], cache.v[0], tables, seq_lens, 128**-0.5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        paged_decode_attention(*args, max_seq_len=2048)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*args, max_seq_len=2048)
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    for i, n in enumerate(lens):
        expected = _dense(q[i : i + 1].cpu(), keys[i][:n], values[i][:n], n - 1, 128**-0.5, None)
        _close(out[i : i + 1], expected, torch.bfloat16)


def test_attention_rejects_bad_arguments():
    cache = KVCache(1, 4, 4, 2, 16, torch.float32, DEVICE)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(2, 6, 16, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens.long(), 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :5], cache.k[0], cache.v[0], tables, lens, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, 1.0, partition_size=24)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.double(), cache.k[0], cache.v[0], tables, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, cache.k[0], cache.v[0], tables, lens, lens, 1, 1.0)


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(16, torch.float32), (24, torch.float32), (16, torch.bfloat16)]
)
def test_rope_and_cache_matches_rotary_and_cache_write(head_dim, dtype):
    heads, kv_heads, block_size, tokens = 6, 2, 4, 9
    cfg = ModelConfig(
        "LlamaForCausalLM", 10, heads * head_dim, 10, 1, heads, kv_heads, head_dim, 64
    )
    rotary = Rotary(cfg, 64, dtype, DEVICE)
    gen = torch.Generator().manual_seed(4)
    # q, k, v are strided views of one fused projection, as in the model
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q0, k0, v0 = (t.view(tokens, -1, head_dim) for t in qkv.split(sizes, -1))
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.to(DEVICE, copy=True).split(sizes, -1))
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(6 * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    fused = KVCache(1, 6, block_size, kv_heads, head_dim, dtype, DEVICE)
    fused.k[0].fill_(NAN)
    fused.v[0].fill_(NAN)
    rope_and_cache_kv(
        q,
        k,
        v,
        positions.to(DEVICE),
        rotary.cos,
        rotary.sin,
        fused.k[0],
        fused.v[0],
        slots.to(DEVICE),
    )

    # reference in fp32 over the same rounded inputs and tables
    cos = rotary.cos.float().cpu()[positions].unsqueeze(1)  # [tokens, 1, head_dim]
    sin = rotary.sin.float().cpu()[positions].unsqueeze(1)
    q_ref = rotary.apply(q0.float(), cos, sin)
    k_ref = rotary.apply(k0.float(), cos, sin)
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)
    expected = KVCache(1, 6, block_size, kv_heads, head_dim, torch.float32, "cpu")
    expected.k[0].fill_(NAN)
    expected.v[0].fill_(NAN)
    real = slots >= 0
    expected.write(0, k_ref[real], v0.float()[real], slots[real])
    # padded tokens leave their (NaN) slots untouched, so NaN must line up exactly
    torch.testing.assert_close(
        fused.k[0].float().cpu(), expected.k[0], atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True
    )
    assert torch.equal(fused.v[0].float().cpu().nan_to_num(7.0), expected.v[0].nan_to_num(7.0))


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_add_rms_norm_matches_model_rms_norm(with_residual, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 200, generator=gen).to(dtype)  # N = 200: a masked, non-power-of-two row
    residual = torch.randn(4, 200, generator=gen).to(dtype) if with_residual else None
    weight = (1 + torch.randn(200, generator=gen)).to(dtype)
    normed, residual_out = fused_add_rms_norm(
        x.to(DEVICE), None if residual is None else residual.to(DEVICE), weight.to(DEVICE), 1e-6
    )
    summed = x + residual if with_residual else x  # added in the model dtype, as HF does
    expected = rms_norm(summed, weight, 1e-6)
    assert normed.dtype == dtype
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # NOTE: Triton 3.7's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)
        _close(residual_out, summed, dtype)
        _close(normed, expected, dtype)
        return
    assert torch.equal(residual_out.cpu(), summed)
    _close(normed, expected, dtype)
    # the normalised value is rounded to the dtype before the weight multiply (HF's order):
    # only rare ties from another summation order may differ, where rounding once would
    # change about a third of the elements
    mismatched = (normed.cpu() != expected).float().mean().item()
    assert mismatched < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(6)
    gate_up = (3 * torch.randn(3, 2 * 1100, generator=gen)).to(dtype)  # two column blocks
    out = silu_and_mul(gate_up.to(DEVICE))
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert out.dtype == dtype and out.shape == (3, 1100)
    _close(out, torch.nn.functional.silu(gate) * up, dtype)
