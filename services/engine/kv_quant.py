"""The KV cache's storage formats: a float dtype, or int8 with per-block scales.

``kv_cache_dtype: auto`` stores keys and values in the dtype of the model's matrix products:
on a CPU with native bf16 under ``dtype: auto`` that is bf16 while activations stay fp32
(``services.engine.precision``), so the cache holds half of fp32's bytes: a decode step reads
half as much context, a block holds twice the tokens, a handoff moves half the bytes. Rows are
rounded once, to nearest even, as they are written; attention widens them back to fp32.

``kv_cache_dtype: int8`` stores each (position, kv head) row of ``head_dim`` values as int8 in
blocks of ``GROUP`` values along ``head_dim``, each block with its own fp32 scale (the Q8_0
layout, as llama.cpp's ``q8_0`` cache): ``x ~= q * scale``, ``scale = max|x| / 127`` over the
block, ``q = round_half_even(x / scale)``. A row is ``head_dim`` int8 bytes followed by
``head_dim / GROUP`` fp32 scales, stored as one uint8 row of ``head_dim * 9 / 8`` bytes.

Why blocks along ``head_dim`` and not one scale per paged block of positions: a paged block
fills one decode step at a time, so its scale would not be known at its first write, and a
later, larger value would force requantizing the positions already stored (compounding
rounding, and invalidating positions already streamed to a decode replica). A per-row scale is
final when the row is written: every write is independent and exact to reproduce, so the
streamed pieces, the exported blocks and the cache hold the same bytes.

Invariant: ``quantize`` here and the C kernel (``cpu_kernels/kernels.c``) produce the same
bytes for the same fp32 inputs (same division, same rounding), so the cpu and torch backends
share one cache format bit for bit.
"""

from __future__ import annotations

import torch

from services.engine.config import KV_DTYPES

GROUP = 32  # values per scale
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# the C kernels' row format codes (cpu_kernels/kernels.c: KV_F32, KV_Q8, KV_BF16)
FORMAT_CODES = {"float32": 0, "int8": 1, "bfloat16": 2}


def resolve_kv_dtype(kv_cache_dtype: str, matmul_dtype_name: str) -> str:
    """The cache's storage format name: for ``auto`` the dtype of the model's matrix products
    (``precision.resolve_matmul_dtype``), else the name given."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of: {', '.join(KV_DTYPES)}"
        )
    return matmul_dtype_name if kv_cache_dtype == "auto" else kv_cache_dtype


def row_layout(kv_dtype: str, head_dim: int) -> tuple[int, torch.dtype]:
    """(elements of one stored (position, kv head) row, their torch dtype) for a format."""
    if kv_dtype == "int8":
        if head_dim % GROUP:
            raise ValueError(
                f"an int8 KV cache needs head_dim divisible by {GROUP}, got {head_dim}"
            )
        return head_dim + head_dim // GROUP * 4, torch.uint8
    try:
        return head_dim, FLOAT_DTYPES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV storage dtype {kv_dtype!r}") from None


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim * 9 / 8] uint8 rows (values, then scales)."""
    d = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], d // GROUP, GROUP)
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    # NOTE: an all-zero block keeps scale 0 and quantizes to zeros (divide by 1, not by 0)
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    out = torch.empty((*x.shape[:-1], d + d // GROUP * 4), dtype=torch.uint8, device=x.device)
    out[..., :d] = q.reshape(*x.shape[:-1], d).view(torch.uint8)
    out[..., d:] = scale.reshape(*x.shape[:-1], d // GROUP).contiguous().view(torch.uint8)
    return out


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize`` up to rounding: [..., row] uint8 -> [..., head_dim] ``dtype``."""
    lead = rows.shape[:-1]
    q = rows[..., :head_dim].view(torch.int8).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    x = q.reshape(*lead, head_dim // GROUP, GROUP) * scale.unsqueeze(-1)
    return x.reshape(*lead, head_dim).to(dtype)
