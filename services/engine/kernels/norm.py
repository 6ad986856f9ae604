"""RMSNorm fused with the residual add that precedes it.

Contract, per row of ``x`` ([T, N]), in HF LlamaRMSNorm's op order (``model.rms_norm``):
``r = x + residual`` rounded to x's dtype (HF adds in the model dtype), then
``normed = weight * (r_fp32 * rsqrt(mean(r_fp32^2) + eps)).to(dtype)``: the fp32 normalised
value is rounded to the dtype before the multiply by ``weight``. Returns ``(normed, r)``.
Sums run in a different order than torch's, so fp32 results agree to ~1e-6, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N], unused unless HAS_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    residual_out_ptr,  # [T, N], unused unless HAS_RESIDUAL
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # fp32 add then one rounding == torch's add in the model dtype
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual``; returns ``(rms_norm(r) * weight, r)``.

    Args:
        x: [T, N], last dim stride 1.
        residual: [T, N] of x's dtype, or None (then ``r`` is ``x`` itself, not a copy).
        weight: [N] of x's dtype.

    Returns:
        (normed, residual_out), both [T, N] in x's dtype.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or a non-unit last stride.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] and weight [N], got {x.shape} and {weight.shape}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must match x's shape {x.shape}, got {residual.shape}")
    others = (weight,) if residual is None else (weight, residual)
    if any(t.dtype != x.dtype or t.device != x.device for t in others):
        raise ValueError("residual and weight must share x's dtype and device")
    if any(t.stride(-1) != 1 for t in (x, *others)):
        raise ValueError("x, residual and weight need a unit stride in their last dim")
    tokens, n = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, N]
    residual_out = x if residual is None else torch.empty_like(out)  # [T, N]
    if tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(n)
    r = x if residual is None else residual  # unread when HAS_RESIDUAL is False
    _add_rms_norm_kernel[(tokens,)](
        x, r, weight, out, residual_out, eps,
        x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        # one row per program: wider rows get more warps so a thread holds few values
        num_warps=min(16, max(4, block // 256)),
    )  # fmt: skip
    return out, residual_out
