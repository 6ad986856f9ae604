"""SwiGLU: ``silu(gate) * up`` over a fused ``gate | up`` projection.

Contract: ``gate_up`` is [T, 2 * I] with gate in columns ``[0, I)`` and up in ``[I, 2I)``
(the model's fused ``gate_up`` output); returns [T, I] in the input dtype, computed in fp32
with a single rounding (torch in bf16 rounds silu(gate) first, so bf16 agrees to ~1 ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * I]
    out_ptr,  # [T, I]
    inter,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + offs, mask=mask, other=0.0)
    out = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> [T, I] = silu(gate) * up.

    Raises:
        ValueError: if gate_up is not 2-D with an even last dim of unit stride.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2 * I] with unit last stride, got {gate_up.shape}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((tokens, inter))  # [T, I]
    if tokens == 0 or inter == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out
