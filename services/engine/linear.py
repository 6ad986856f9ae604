"""The linear layers of the model: dense (fp32 / bf16 / fp16) and weight-only quantized.

``make_linear`` picks by the weight's type; the model never branches on the format.
Kernel choice: see ``services.engine.row_roles``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.engine.packed_gemm import packed_gemm
from services.engine.quant import QuantLinear, QuantWeight
from services.engine.row_roles import RowRoles

# NOTE: below this many rows a plain product over [in, out] weights is fastest (it runs as a
# matrix-vector product); from here on oneDNN's pre-packed weights win, because an unpacked GEMM
# re-packs the whole weight matrix on every call (measured: 2x at 8 rows, 1.4x at 32).
PACKED_MIN_ROWS = 4

Weight = torch.Tensor | QuantWeight


class LinearLayer(Protocol):
    @property
    def nbytes(self) -> int:
        """Bytes of weights (and bias) one pass reads."""
        ...

    def __call__(
        self, x: torch.Tensor, roles: RowRoles | None = None, *, keep: bool = False
    ) -> torch.Tensor:
        """``keep``: where the packed GEMM runs, its result in the packed dtype (bf16 under
        fp32 activations on AMX hosts) instead of ``x``'s; elsewhere ignored. ``x`` may
        come in ``input_dtype(rows, roles)`` instead of the activations' dtype."""
        ...

    def input_dtype(self, rows: int, roles: RowRoles | None) -> torch.dtype | None:
        """The narrower dtype a call over ``rows`` rows rounds every input row to first (the
        packed GEMM's bf16 under fp32 activations), or None: the caller may hand the rows
        over already rounded (the same bits, one conversion pass less)."""
        ...


class Linear:
    """``y = x @ W.T + b`` with the weight laid out for the fastest path at each batch size.

    ``pack``: the dtype of oneDNN's pre-packed copy (None: no copy). Packed in bf16 under fp32
    activations (``dtype: auto`` on a CPU with AMX / AVX512-BF16) every call runs the packed
    GEMM: inputs rounded to bf16, fp32 accumulation, outputs back in the activations' dtype;
    no fp32 copy of the weight is kept.
    """

    def __init__(
        self, w: torch.Tensor, bias: torch.Tensor | None, pack: torch.dtype | None
    ) -> None:
        # w: [out, in] as in HF checkpoints
        self.bias = bias
        self.act_dtype = w.dtype  # the activations' (a dense model's weights are in its dtype)
        self.packed = packed_gemm(w, pack)
        self.in_features = w.shape[1]
        # NOTE: a copy in another dtype than the weights' is the only copy: every row packs
        self.w_t = w.t().contiguous() if self.packed is None or pack == w.dtype else None
        width = w.element_size() if self.w_t is not None else pack.itemsize  # type: ignore[union-attr]
        self._nbytes = w.numel() * width
        if bias is not None:
            self._nbytes += bias.numel() * bias.element_size()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def _packs(self, rows: int, roles: RowRoles | None) -> bool:
        return self.packed is not None and (
            roles is not None or self.w_t is None or rows >= PACKED_MIN_ROWS
        )

    def input_dtype(self, rows: int, roles: RowRoles | None) -> torch.dtype | None:
        # NOTE: never with roles (batch_invariant): a quantized layer's generated rows read
        # fp32 rows there, and one rule for every layer keeps the model's side simple
        if roles is None and self._packs(rows, roles):
            assert self.packed is not None
            return self.packed.dtype if self.packed.dtype != self.act_dtype else None
        return None

    def __call__(
        self, x: torch.Tensor, roles: RowRoles | None = None, *, keep: bool = False
    ) -> torch.Tensor:
        # NOTE: with roles every row runs the packed GEMM: the plain product rounds rows
        # differently below 4 rows (MKL's matrix-vector path), oneDNN's does not
        if self._packs(x.shape[0], roles):
            assert self.packed is not None
            return self.packed(
                x, self.bias, invariant=roles is not None, keep=keep, out_dtype=self.act_dtype
            )
        assert self.w_t is not None
        return torch.addmm(self.bias, x, self.w_t) if self.bias is not None else x @ self.w_t


def make_linear(w: Weight, bias: torch.Tensor | None, pack: torch.dtype | None) -> LinearLayer:
    if isinstance(w, QuantWeight):
        return QuantLinear(w, bias, pack)
    return Linear(w, bias, pack)


def fuse(parts: list[Weight]) -> Weight:
    """Stack weights along ``out`` (q|k|v, gate|up); every part in one format."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts)  # type: ignore[arg-type]
    if any(isinstance(p, QuantWeight) for p in parts):
        raise ValueError("cannot fuse quantized and dense weights")
    return torch.cat(parts)  # type: ignore[arg-type]
