"""oneDNN's GEMM over weights packed once at load: the CPU's prefill and large-batch path.

The packed copy's dtype is the engine's matmul dtype (``services.engine.precision``): fp32, or
bf16 on CPUs with AMX / AVX512-BF16 (measured on one AMX core: 5-7x the fp32 GEMM's rate at
prefill sizes), also under fp32 activations.
"""

from __future__ import annotations

import torch

# NOTE: measured with torch 2.13's oneDNN on AMX; tests/engine/test_packed_gemm.py checks it
BF16_INVARIANT_ROWS = 32


class PackedGemm:
    """oneDNN's GEMM over a weight packed once at load, in ``dtype``.

    A bf16 copy under fp32 activations computes in bf16 (AMX tiles where the CPU has them:
    measured 5-7x the fp32 GEMM's rate on one core) and returns fp32. ``invariant``: every row's
    result must not depend on the call's other rows (``batch_invariant``). oneDNN's fp32 GEMM
    gives that at any size; its bf16 GEMM only within calls of up to ``BF16_INVARIANT_ROWS``
    rows (measured: bit-equal rows for 1-32 rows at any offset, different rounding above), so
    invariant bf16 calls run in slices of that many rows (about half the full call's rate).
    """

    def __init__(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, *, invariant: bool, keep: bool = False
    ) -> torch.Tensor:
        """``x @ w.T + bias`` in ``x``'s dtype, or (``keep``) in the packed dtype: a bf16
        result that feeds another bf16 GEMM skips two conversions."""
        if x.dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, bias, "none", [], "")
        rows = x.shape[0]
        step = BF16_INVARIANT_ROWS if invariant and self.dtype != torch.float32 else rows
        xc = x.to(self.dtype)
        parts = [
            torch.ops.mkldnn._linear_pointwise(xc[a : a + step], self.w, None, "none", [], "")
            for a in range(0, rows, max(step, 1))
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = y if keep else y.to(x.dtype)
        return y.add_(bias.to(y.dtype)) if bias is not None else y


def packed_gemm(w: torch.Tensor, dtype: torch.dtype | None) -> PackedGemm | None:
    return None if dtype is None else PackedGemm(w, dtype)
