"""Paged decode attention (flash-decoding): one query token per sequence, the context split
into partitions whose partial results a reduce kernel combines. Contract: ``paged_common``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.paged_common import (
    LOG2E,
    MIN_DOT,
    _dot,
    _slot_offsets,
    _softmax_step,
    check_paged,
    dot_mode,
)

DECODE_BLOCK_N = 64  # keys per tile: decode streams K/V, memory-bound


@triton.jit
def _partition_keys(part_start, seq_len, window, PARTITION: tl.constexpr, USE_WINDOW: tl.constexpr):
    # [key_lo, key_hi): the keys of one partition that the sequence's last token attends.
    # Shared by the partition and reduce kernels so both agree on which partitions wrote scratch.
    lo = part_start
    if USE_WINDOW:
        lo = tl.maximum(part_start, seq_len - window)
    return lo, tl.minimum(part_start + PARTITION, seq_len)


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [KVH, num_blocks, block_size, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D], written only when DIRECT
    m_ptr,  # [B, H, P] fp32 scratch: running max (log2 units)
    l_ptr,  # [B, H, P] fp32 scratch: sum of exp2
    acc_ptr,  # [B, H, P, D] fp32 scratch: un-normalised output
    qk_scale,
    window,
    stride_qb,
    stride_qh,
    stride_ch,
    stride_cb,
    stride_ct,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * GROUP + offs_g  # [GROUP_PAD]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    seq_len = tl.load(seq_lens_ptr + b)
    key_lo, key_hi = _partition_keys(part * PARTITION, seq_len, window, PARTITION, USE_WINDOW)
    if key_lo >= key_hi:
        # the grid is sized for the longest possible context: most programs land here
        if DIRECT:
            zeros = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, zeros, mask=g_mask[:, None] & d_mask[None, :])
        return

    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
    if WIDEN:
        q = q.to(tl.float32)
    table_row = block_tables_ptr + b * stride_bt
    k_base = k_cache_ptr + kvh.to(tl.int64) * stride_ch
    v_base = v_cache_ptr + kvh.to(tl.int64) * stride_ch
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # tiles stay aligned to the partition; tiles wholly below the window are skipped
    first = part * PARTITION + (key_lo - part * PARTITION) // BLOCK_N * BLOCK_N
    for start in range(first, key_hi, BLOCK_N):
        kp = start + offs_n  # [BLOCK_N]
        valid = (kp >= key_lo) & (kp < key_hi)
        slot = _slot_offsets(table_row, kp, valid, BLOCK_SIZE, stride_cb, stride_ct)
        k_ptrs = k_base + slot[None, :] + offs_d[:, None]
        k = tl.load(k_ptrs, mask=d_mask[:, None] & valid[None, :], other=0.0)  # [D_PAD, BLOCK_N]
        v_ptrs = v_base + slot[:, None] + offs_d[None, :]
        v = tl.load(v_ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, D_PAD]
        s = _dot(q, k, PRECISION, WIDEN) * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, PRECISION, WIDEN)

    if DIRECT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        num_heads = tl.num_programs(1) * GROUP
        row = (b * num_heads + heads) * tl.num_programs(2) + part  # [GROUP_PAD]
        tl.store(m_ptr + row, m_i, mask=g_mask)
        tl.store(l_ptr + row, l_i, mask=g_mask)
        a_ptrs = acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    seq_lens_ptr,  # [B] int32
    m_ptr,  # [B, H, P] fp32
    l_ptr,  # [B, H, P] fp32
    acc_ptr,  # [B, H, P, D] fp32
    out_ptr,  # [B, H, D]
    window,
    num_partitions,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
    PART_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    parts = tl.arange(0, PART_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    key_lo, key_hi = _partition_keys(parts * PARTITION, seq_len, window, PARTITION, USE_WINDOW)
    # exactly the partitions that wrote scratch this launch; the rest hold stale values
    wrote = (parts < num_partitions) & (key_lo < key_hi)  # [PART_PAD]
    row = (b * tl.num_programs(1) + h) * num_partitions + parts
    m = tl.load(m_ptr + row, mask=wrote, other=float("-inf"))
    l_part = tl.load(l_ptr + row, mask=wrote, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 where nothing was written
    l_sum = tl.sum(l_part * w, 0)
    a_ptrs = acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(a_ptrs, mask=wrote[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)  # [HEAD_DIM_PAD]
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    partition_size: int = 512,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, attending its whole cached context (flash-decoding).

    Args:
        q: [B, H, D] queries, RoPE applied; their own K/V are already in the cache.
        k_cache, v_cache: [KVH, num_blocks, block_size, D].
        block_tables: [B, max_blocks] int32; seq_lens: [B] int32 context lengths, the current
            token included (0 = padding, yields zeros).
        partition_size: tokens per split-K partition, a power of two >= 16.
        max_seq_len: bound on every seq_len that sizes the grid (pass max_model_len under CUDA
            graphs); None reads ``seq_lens.max()``, a host sync. Longer contexts are truncated.

    Returns:
        [B, H, D] in q's dtype.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    group = check_paged(q, k_cache, v_cache, block_tables, seq_lens, sliding_window)
    if seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{q.shape[0]} queries but {seq_lens.shape[0]} sequences")
    if partition_size < MIN_DOT or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    batch, heads, head_dim = q.shape
    out = q.new_empty((batch, heads, head_dim))  # [B, H, D]
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    direct = num_partitions == 1  # one partition: normalise in place, no scratch, no reduce
    if direct:
        m = sums = acc = out  # unused by the kernel
    else:
        m = torch.empty((batch, heads, num_partitions), dtype=torch.float32, device=q.device)
        sums = torch.empty_like(m)
        acc = q.new_empty((batch, heads, num_partitions, head_dim), dtype=torch.float32)
    precision, widen = dot_mode(q.dtype)
    head_dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    window = sliding_window or 0
    # NOTE: the group is padded to 16 rows for tl.dot rather than computed as elementwise
    # products: decode is memory-bound, so idle tensor-core rows cost nothing, while a
    # [group, BLOCK_N, D] product would spill registers at D = 128
    _decode_partition_kernel[(batch, k_cache.shape[0], num_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, out, m, sums, acc,
        scale * LOG2E, window,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group,
        GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=k_cache.shape[2],
        PARTITION=partition_size,
        BLOCK_N=min(partition_size, DECODE_BLOCK_N),
        USE_WINDOW=sliding_window is not None,
        DIRECT=direct,
        PRECISION=precision,
        WIDEN=widen,
    )  # fmt: skip
    if not direct:
        _decode_reduce_kernel[(batch, heads)](
            seq_lens, m, sums, acc, out, window, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITION=partition_size,
            PART_PAD=triton.next_power_of_2(num_partitions),
            USE_WINDOW=sliding_window is not None,
        )  # fmt: skip
    return out
