"""The registry of compute backends: attention over the paged cache plus the fused layer ops.

``torch`` is the reference. ``cpu`` (the default on CPU for fp32 models) runs the layer ops and
decode attention as pdserve's C kernels. ``triton`` (the default on CUDA) runs paged attention,
RoPE + KV write, residual + RMSNorm and SwiGLU as Triton kernels; it is imported only when
chosen, so CPU machines never import Triton. ``auto`` picks by device and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.attention import AttentionBackend, TorchAttention
from services.engine.layer_ops import LayerOps, TorchOps


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    attention: AttentionBackend
    ops: LayerOps
    # its launches read every size from device tensors, so a CUDA graph may capture a decode
    # step once per batch bucket and replay it (the torch reference slices by host lengths)
    graph_safe: bool
    # reads and writes a KV cache stored in another format than the model's dtype (int8 rows of
    # services.engine.kv_quant, or another float dtype)
    kv_conversion: bool = True


def _load_torch(prompt_dtype: torch.dtype | None) -> Backend:
    return Backend("torch", TorchAttention(prompt_dtype), TorchOps(), graph_safe=False)


def _load_cpu(prompt_dtype: torch.dtype | None) -> Backend:
    from services.engine.cpu_backend import CpuAttention, CpuOps

    return Backend("cpu", CpuAttention(prompt_dtype), CpuOps(), graph_safe=False)


def _load_triton(prompt_dtype: torch.dtype | None) -> Backend:
    # NOTE: its prompt attention computes in the model's dtype (bf16 by default on CUDA)
    from services.engine.triton_backend import TritonAttention, TritonOps

    return Backend("triton", TritonAttention(), TritonOps(), graph_safe=True, kv_conversion=False)


# name -> loader(prompt_dtype): the dtype prompt attention computes in (None: the model's)
BACKENDS: dict[str, Callable[[torch.dtype | None], Backend]] = {
    "torch": _load_torch,
    "cpu": _load_cpu,
    "triton": _load_triton,
}


def resolve_backend_name(
    name: str, device: str, dtype: torch.dtype = torch.float32, head_dim: int = 64
) -> str:
    """``auto`` -> ``triton`` on CUDA; on CPU ``cpu`` (pdserve's C kernels) for fp32 models
    where they build, else ``torch``; other names pass through."""
    if name != "auto":
        return name
    if str(device).startswith("cuda"):
        return "triton"
    from services.engine.cpu_backend import supports

    return "cpu" if supports(dtype, head_dim) else "torch"


def get_backend(
    name: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    head_dim: int = 64,
    prompt_dtype: torch.dtype | None = None,
) -> Backend:
    """Instantiate a backend by name (or ``auto``); the error lists the valid names.
    ``prompt_dtype``: the dtype prompt attention computes in, where it is not ``dtype`` (the
    matmul dtype under ``dtype: auto`` on a CPU with native bf16)."""
    name = resolve_backend_name(name, device, dtype, head_dim)
    try:
        loader = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}"
        ) from None
    return loader(None if prompt_dtype == dtype else prompt_dtype)
