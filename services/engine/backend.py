"""The registry of compute backends: attention over the paged cache plus the fused layer ops.

``torch`` is the reference and the CPU path. ``triton`` (the default on CUDA) runs paged
attention, RoPE + KV write, residual + RMSNorm and SwiGLU as Triton kernels; it is imported
only when chosen, so CPU machines never import Triton. ``auto`` picks by device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def _load_torch() -> Backend:
    return Backend("torch", TorchAttention(), TorchOps(), graph_safe=False)


def _load_triton() -> Backend:
    from services.engine.triton_backend import TritonAttention, TritonOps

    return Backend("triton", TritonAttention(), TritonOps(), graph_safe=True)


BACKENDS: dict[str, Callable[[], Backend]] = {"torch": _load_torch, "triton": _load_triton}


def resolve_backend_name(name: str, device: str) -> str:
    """``auto`` -> ``triton`` on CUDA, ``torch`` elsewhere; other names pass through."""
    if name != "auto":
        return name
    return "triton" if str(device).startswith("cuda") else "torch"


def get_backend(name: str, device: str = "cpu") -> Backend:
    """Instantiate a backend by name (or ``auto``); the error lists the valid names."""
    name = resolve_backend_name(name, device)
    try:
        loader = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}"
        ) from None
    return loader()
