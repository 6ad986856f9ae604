"""The per-layer operations around the matmuls, as one swappable set.

The torch set is the reference, with HF transformers' op order, so fp32 results match it bit
for bit. The Triton set (``services.engine.triton_backend``) fuses each into one kernel: the
residual add with RMSNorm, RoPE with the KV cache write, SiLU with the gate product.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine.kv_cache import KVCache
from services.engine.rope import Rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's LlamaRMSNorm, so fp32 results match bit for bit.
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LayerOps(Protocol):
    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual) * weight, x + residual); residual None means 0.
        ``out_dtype``: the normed rows rounded to it (the dtype the next linear computes
        in, ``LinearLayer.input_dtype``); None keeps the sum's dtype. ``x`` may be in a
        narrower dtype than ``residual`` (a linear's ``keep`` result): the sum is in the
        residual's."""
        ...

    def rope_tables(self, positions: torch.Tensor, rotary: Rotary) -> object:
        """Once per step: what ``rope_and_cache`` needs for these positions ([num_tokens])."""
        ...

    def rope_and_cache(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        rope: object,  # rope_tables' result for this step
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k, writes k and v to ``layer`` of the cache; returns (q, k) rotated."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * inter] (gate | up) -> silu(gate) * up, [num_tokens, inter]."""
        ...


class TorchOps:
    """Reference implementations (and the CPU path)."""

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual  # NOTE: a narrower x is promoted to the residual's dtype
        out = rms_norm(x, weight, eps)
        return out.to(out_dtype or out.dtype), x

    def rope_tables(
        self, positions: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: gathered once per step, not per layer (two small ops a layer add up on CPU)
        cos = rotary.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = rotary.sin[positions].unsqueeze(1)
        return cos, sin

    def rope_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: object,
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope  # type: ignore[misc]
        q = Rotary.apply(q, cos, sin)
        k = Rotary.apply(k, cos, sin)
        cache.write(layer, k, v, slot_mapping)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
