"""The linear layers of the model: dense (fp32 / bf16 / fp16) and weight-only quantized.

``make_linear`` picks by the weight's type; the model never branches on the format.
Kernel choice: see ``services.engine.row_roles``.
"""

from __future__ import annotations

from typing import Protocol

import torch

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

    def __call__(self, x: torch.Tensor, roles: RowRoles | None = None) -> torch.Tensor: ...


class Linear:
    """``y = x @ W.T + b`` with the weight laid out for the fastest path at each batch size."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> None:
        # w: [out, in] as in HF checkpoints
        self.w_t = w.t().contiguous()  # [in, out]
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None) if prepack else None

    @property
    def nbytes(self) -> int:
        n = self.w_t.numel() + (self.bias.numel() if self.bias is not None else 0)
        return n * self.w_t.element_size()

    def __call__(self, x: torch.Tensor, roles: RowRoles | None = None) -> torch.Tensor:
        # NOTE: with roles every row runs the packed GEMM: the plain product rounds rows
        # differently below 4 rows (MKL's matrix-vector path), oneDNN's does not
        if self.packed is not None and (roles is not None or x.shape[0] >= PACKED_MIN_ROWS):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.addmm(self.bias, x, self.w_t) if self.bias is not None else x @ self.w_t


def make_linear(w: Weight, bias: torch.Tensor | None, prepack: bool) -> LinearLayer:
    if isinstance(w, QuantWeight):
        return QuantLinear(w, bias, prepack)
    return Linear(w, bias, prepack)


def fuse(parts: list[Weight]) -> Weight:
    """Stack weights along ``out`` (q|k|v, gate|up); every part in one format."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts)  # type: ignore[arg-type]
    if any(isinstance(p, QuantWeight) for p in parts):
        raise ValueError("cannot fuse quantized and dense weights")
    return torch.cat(parts)  # type: ignore[arg-type]
