"""Paged prefill attention (flash-attention over block tables): chunked prefill, cached
prefixes and mixed batches in one launch. Contract: ``paged_common``."""

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

# a tensor-core GEMM pair per tile
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # sequence s owns tiles [qsl[s] // BLOCK_Q + s, ...): room for its cdiv(q_len, BLOCK_Q)
    # tiles without a host-side prefix sum; binary search for the last start <= tile
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [KVH, num_blocks, block_size, D]
    v_cache_ptr,
    block_tables_ptr,  # [S, max_blocks] int32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [T, H, D]
    qk_scale,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ch,
    stride_cb,
    stride_ct,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # one program: BLOCK_Q queries of one sequence x the GROUP heads of one KV head, as rows
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return  # the grid is an upper bound on the number of tiles
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    q_idx = local * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index within the sequence
    heads = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    qp = seq_len - q_len + q_idx  # positions: the cached prefix comes first
    q_ptrs = q_ptr + (q_start + q_idx)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)

    first_qp = seq_len - q_len + local * BLOCK_Q
    key_hi = tl.minimum(first_qp + BLOCK_Q, seq_len)  # tiles above the diagonal never load
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(first_qp - window + 1, 0)  # nor do tiles below the window
    table_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kvh.to(tl.int64) * stride_ch
    v_base = v_cache_ptr + kvh.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(key_lo // BLOCK_N * BLOCK_N, key_hi, BLOCK_N):
        kp = start + offs_n  # [BLOCK_N]
        loaded = kp < key_hi
        slot = _slot_offsets(table_row, kp, loaded, BLOCK_SIZE, stride_cb, stride_ct)
        k_ptrs = k_base + slot[None, :] + offs_d[:, None]
        k = tl.load(k_ptrs, mask=d_mask[:, None] & loaded[None, :], other=0.0)  # [D_PAD, BLOCK_N]
        v_ptrs = v_base + slot[:, None] + offs_d[None, :]
        v = tl.load(v_ptrs, mask=loaded[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, D_PAD]
        s = _dot(q, k, PRECISION, WIDEN) * qk_scale  # [BLOCK_M, BLOCK_N]
        allowed = kp[None, :] <= qp[:, None]
        if USE_WINDOW:
            allowed = allowed & (kp[None, :] > qp[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        acc, m_i, l_i = _softmax_step(s, v, acc, m_i, l_i, PRECISION, WIDEN)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + (q_start + q_idx)[:, None] * stride_ot + heads[:, None] * stride_oh
    o_mask = row_mask[:, None] & d_mask[None, :]
    tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for a flat batch of new tokens over cached prefixes (flash-attention).

    Query j of sequence s sits at position ``seq_lens[s] - q_len_s + j``: a cached prefix comes
    before the first query (chunked prefill, prefix hit). Sequences may mix decodes (q_len 1),
    fresh prompts and prompts over cached prefixes.

    Args:
        q: [T, H, D] the step's tokens, RoPE applied; their K/V are already in the cache.
        k_cache, v_cache: [KVH, num_blocks, block_size, D].
        block_tables: [S, max_blocks] int32.
        query_start_loc: [S + 1] int32 cumulative query lengths (0 first, T last).
        seq_lens: [S] int32 context length per sequence, this step's tokens included.
        max_query_len: longest q_len_s (host-side); sizes the query tile, so an under-estimate
            only costs speed.

    Rows of q past ``query_start_loc[-1]`` (padding) are left unwritten in the output.

    Returns:
        [T, H, D] in q's dtype.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices.
    """
    group = check_paged(q, k_cache, v_cache, block_tables, seq_lens, sliding_window)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] int32")
    if query_start_loc.device != q.device:
        raise ValueError("query_start_loc must be on q's device")
    tokens, heads, head_dim = q.shape
    out = q.new_empty((tokens, heads, head_dim))  # [T, H, D]
    if tokens == 0 or num_seqs == 0:
        return out
    # rows = queries x group heads; a tile holds at least one query's whole group
    rows = triton.next_power_of_2(group * max(1, max_query_len))
    block_m = max(MIN_DOT, triton.next_power_of_2(group), min(PREFILL_BLOCK_M, rows))
    block_q = block_m // group
    # sequence s needs cdiv(q_len_s, block_q) <= q_len_s // block_q + 1 tiles: a host-free bound
    num_tiles = tokens // block_q + num_seqs
    precision, widen = dot_mode(q.dtype)
    _prefill_kernel[(num_tiles, k_cache.shape[0])](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=PREFILL_BLOCK_N,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[2],
        USE_WINDOW=sliding_window is not None,
        PRECISION=precision,
        WIDEN=widen,
    )  # fmt: skip
    return out
