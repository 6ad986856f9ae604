"""oneDNN's GEMM over weights packed once at load: the CPU's prefill and large-batch path.

The packed copy's dtype is the engine's matmul dtype (``services.engine.precision``): fp32, or
bf16 on CPUs with AMX / AVX512-BF16 (measured on one AMX core: 5-7x the fp32 GEMM's rate at
prefill sizes), also under fp32 activations.
"""

from __future__ import annotations

import functools

import torch

from services.engine.cpu_kernels import library

# NOTE: measured with torch 2.13's oneDNN on AMX; tests/engine/test_packed_gemm.py checks it
BF16_INVARIANT_ROWS = 32


@functools.cache
def bf16_slices() -> bool:
    """Whether invariant bf16 calls must run in slices: oneDNN's AMX path rounds some rows of
    a call over ``BF16_INVARIANT_ROWS`` rows differently; its AVX512-BF16 path (a Zen 4 core,
    measured up to 2,048 rows at any offset, SmolLM2's shapes) rounds every row of 2 or more
    alike, and slices would cost 10-15% of a prompt's linears there."""
    return "amx_bf16" in library.cpu_flags()


class PackedGemm:
    """oneDNN's GEMM over a weight packed once at load, in ``dtype``.

    A bf16 copy under fp32 activations computes in bf16 (AMX tiles where the CPU has them:
    measured 5-7x the fp32 GEMM's rate on one core) and returns fp32. ``invariant``: every row's
    result must not depend on the call's other rows (``batch_invariant``). oneDNN's fp32 GEMM
    gives that at any size; its bf16 GEMM only within calls of up to ``BF16_INVARIANT_ROWS``
    rows (measured: bit-equal rows for 1-32 rows at any offset, different rounding above), so
    invariant bf16 calls run in slices of that many rows on AMX hosts (about half the full
    call's rate; ``bf16_slices``). A call of one row takes oneDNN's matrix-vector path, which
    rounds differently from the GEMM at long inputs (fp32 and bf16, measured at 1,536 inputs:
    every row in fp32, one in nine in bf16), so an invariant row alone is computed as two.
    """

    def __init__(self, w: torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.w = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)

    def __call__(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        invariant: bool,
        keep: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``x @ w.T + bias`` in ``out_dtype`` (None: ``x``'s), or (``keep``) in the packed
        dtype: a bf16 result that feeds another bf16 GEMM skips two conversions. ``x`` may
        come already rounded to the packed dtype (``out_dtype`` then the activations')."""
        out_dtype = out_dtype or x.dtype
        sliced = invariant and self.dtype != torch.float32 and bf16_slices()
        if x.dtype == self.dtype == out_dtype and not sliced:
            return self._gemm(x, bias, whole=invariant)
        rows = x.shape[0]
        step = BF16_INVARIANT_ROWS if sliced else rows
        xc = x.to(self.dtype)
        parts = [
            self._gemm(xc[a : a + step], None, whole=invariant)
            for a in range(0, rows, max(step, 1))
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = y if keep else y.to(out_dtype)
        return y.add_(bias.to(y.dtype)) if bias is not None else y

    def _gemm(
        self, x: torch.Tensor, bias: torch.Tensor | None, *, whole: bool = False
    ) -> torch.Tensor:
        """One oneDNN call; ``whole``: a single row runs as two, the GEMM's rounding."""
        if whole and x.shape[0] == 1:
            return self._gemm(torch.cat([x, x]), bias)[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.w, bias, "none", [], "")


def packed_gemm(w: torch.Tensor, dtype: torch.dtype | None) -> PackedGemm | None:
    return None if dtype is None else PackedGemm(w, dtype)
