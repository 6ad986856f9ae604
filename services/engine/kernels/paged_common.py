"""Attention over the paged KV cache: flash-decoding for decode, flash-attention for prefill.

Contract shared by both kernels:
- ``k_cache``/``v_cache``: ``[num_kv_heads, num_blocks, block_size, head_dim]`` (same shape and
  strides, last dim stride 1); position ``p`` of a sequence is at block ``table[p // block_size]``,
  offset ``p % block_size``. The step's own keys and values are already in the cache.
- A query at position ``qp`` attends key ``kp`` iff ``kp <= qp`` and, with a window ``w``,
  ``kp > qp - w``. Scores are scaled by ``scale``; softmax is online, in base 2, with fp32
  statistics and accumulators; the output has q's dtype.
- Heads are grouped (GQA): query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``,
  and one program serves a whole group, so each K/V tile is loaded once per group.
- Sequences with nothing to attend (``seq_len == 0``, CUDA-graph padding) produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# NOTE: tl.dot needs every dim >= 16 on the GPU: query rows, head_dim and key tiles pad to it
MIN_DOT = 16


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    # NOTE: Triton 3.7's interpreter multiplies bf16 bit patterns as integers in tl.dot; widening
    # to fp32 there is exact (bf16 -> fp32 is lossless, and tensor cores accumulate in fp32)
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _slot_offsets(table_row_ptr, kp, valid, BLOCK_SIZE: tl.constexpr, stride_b, stride_t):
    # int64: block * stride overflows int32 in a large pool
    block = tl.load(table_row_ptr + kp // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_b + (kp % BLOCK_SIZE) * stride_t


@triton.jit
def _softmax_step(s, v, acc, m_i, l_i, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    # s: [M, N] scores in log2 units, -inf where masked; v: [N, D]; acc: [M, D]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row whose keys so far are all masked keeps m = -inf: shift by 0 so exp2 never sees inf-inf
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
    return acc, m_new, l_i


# NOTE: the interpreter (TRITON_INTERPRET=1) wraps jit functions in another type
INTERPRETED = not isinstance(_dot, triton.runtime.JITFunction)


def dot_mode(dtype: torch.dtype) -> tuple[str, bool]:
    # fp32 models get exact products (tf32 would cost ~1e-3 relative error)
    return ("ieee" if dtype == torch.float32 else "tf32"), INTERPRETED and dtype == torch.bfloat16


def check_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> int:
    """Validate the arguments both kernels share; returns the GQA group size."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [tokens, heads, head_dim] with a unit last stride, got {q.shape}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must be [num_kv_heads, num_blocks, block_size, head_dim] of one "
            f"shape and strides, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} must match q's {q.shape[2]}, stride 1")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q and caches must share a dtype, got {q.dtype}, {k_cache.dtype}")
    if q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[0]}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [num_seqs, max_blocks] int32 with unit last stride")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"seq_lens must be [{block_tables.shape[0]}] int32 (one per block table)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}) != 1:
        raise ValueError("q, caches, block_tables and seq_lens must be on one device")
    return q.shape[1] // k_cache.shape[0]
