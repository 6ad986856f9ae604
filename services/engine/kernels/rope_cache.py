"""RoPE on q and k, fused with the write of k and v into the paged KV cache.

Contract: for every token t, with ``c = cos[positions[t]]`` and ``s = sin[positions[t]]`` (HF
"rotate half" tables, ``[max_positions, head_dim]`` built from ``cat(freqs, freqs)``),
``x <- x * c + rotate_half(x) * s`` for q and k in place, where
``rotate_half(x) = cat(-x[D/2:], x[:D/2])``; math in fp32, one rounding to the tensor's dtype.
Then rotated k and v go to slot ``slot_mapping[t]`` (``block * block_size + offset``) of every
KV head of ``k_cache``/``v_cache`` (``[num_kv_heads, num_blocks, block_size, head_dim]``);
tokens with a negative slot (padding) are rotated but not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr,
    stride_h,
    c1,
    c2,
    s1,
    s2,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # x_ptr: one token's [NUM_HEADS, 2 * HALF] rows; rotated in place; returns both halves (fp32)
    offs_h = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, HALF_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs < HALF)[None, :]
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(ptrs, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)
    return y1, y2


@triton.jit
def _rope_cache_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    positions_ptr,  # [T] int64
    cos_ptr,  # [max_positions, D]
    sin_ptr,  # [max_positions, D]
    k_cache_ptr,  # [KVH, num_blocks, block_size, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64, < 0 = do not write
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_ch,
    stride_cb,
    stride_ct,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    offs = tl.arange(0, HALF_PAD)
    half_mask = offs < HALF
    # both halves of the tables are loaded: the contract is the full-width formula, whatever
    # the table holds
    c1 = tl.load(cos_ptr + pos * stride_cos + offs, mask=half_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_sin + offs, mask=half_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr + t * stride_qt, stride_qh, c1, c2, s1, s2, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    k1, k2 = _rotate(
        k_ptr + t * stride_kt, stride_kh, c1, c2, s1, s2, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD
    )

    slot = tl.load(slot_ptr + t)
    offs_h = tl.arange(0, KV_HEADS_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & half_mask[None, :] & (slot >= 0)
    safe = tl.maximum(slot, 0)  # padding's address is computed but never stored to
    cache_off = (
        offs_h[:, None].to(tl.int64) * stride_ch
        + (safe // BLOCK_SIZE) * stride_cb
        + (safe % BLOCK_SIZE) * stride_ct
        + offs[None, :]
    )  # [KV_HEADS_PAD, HALF_PAD]
    dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache_off, k1.to(dtype), mask=mask)
    tl.store(k_cache_ptr + cache_off + HALF, k2.to(dtype), mask=mask)
    v_ptrs = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs[None, :]
    v1 = tl.load(v_ptrs, mask=mask, other=0.0)
    v2 = tl.load(v_ptrs + HALF, mask=mask, other=0.0)
    tl.store(v_cache_ptr + cache_off, v1.to(dtype), mask=mask)
    tl.store(v_cache_ptr + cache_off + HALF, v2.to(dtype), mask=mask)


def rope_and_cache_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q and k in place and write rotated k and v to the cache.

    Args:
        q: [T, H, D]; k, v: [T, KVH, D]. May be strided views (of a fused qkv output, say);
            only the last dim must have stride 1.
        positions: [T] int64, each in ``[0, max_positions)`` (padding tokens too).
        cos, sin: [max_positions, D] rotate-half tables, last dim stride 1.
        k_cache, v_cache: [KVH, num_blocks, block_size, D], one shape and strides.
        slot_mapping: [T] int64 cache slot per token; negative = padding, not written.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[::2] != k.shape[::2]:
        raise ValueError(
            f"q must be [T, H, D] and k, v [T, KVH, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache)):
        raise ValueError("q, k, v, cos, sin and the caches need a unit stride in their last dim")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError(f"cos and sin must be [max_positions, {head_dim}], got {cos.shape}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one 4-D shape and strides")
    if k_cache.shape[0] != kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold {kv_heads} x {head_dim}")
    if not (q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype):
        raise ValueError("q, k, v must share a dtype, and so must the caches")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.dtype != torch.int64 or idx.shape != (tokens,):
            raise ValueError(f"{name} must be [{tokens}] int64, got {idx.dtype} {idx.shape}")
    tensors = (q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all tensors must be on one device")
    if tokens == 0:
        return
    half = head_dim // 2
    _rope_cache_kernel[(tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), *k_cache.stride()[:3],
        NUM_HEADS=heads,
        NUM_KV_HEADS=kv_heads,
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[2],
    )  # fmt: skip
