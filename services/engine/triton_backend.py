"""The Triton backend: paged attention and the fused layer ops as Triton kernels.

Every launch takes its sizes from device tensors or from bounds fixed per engine
(``meta.max_seq_len``), never from a host copy of per-step lengths, so a decode step can be
captured as a CUDA graph. Imported only when the backend is chosen (CPU machines run it only
under ``TRITON_INTERPRET=1``, in the tests).
"""

from __future__ import annotations

import torch

from services.engine.attention import AttentionMetadata
from services.engine.kernels.activation import silu_and_mul
from services.engine.kernels.norm import fused_add_rms_norm
from services.engine.kernels.paged_decode import paged_decode_attention
from services.engine.kernels.paged_prefill import paged_prefill_attention
from services.engine.kernels.rope_cache import rope_and_cache_kv
from services.engine.kv_cache import KVCache
from services.engine.rope import Rotary


class TritonAttention:
    def prepare(self, meta: AttentionMetadata) -> None:
        meta.plan = None  # the kernels read the metadata's tensors directly

    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        kc, vc = cache.k[layer], cache.v[layer]
        scale = q.shape[-1] ** -0.5
        if meta.is_pure_decode:
            return paged_decode_attention(
                q,
                kc,
                vc,
                meta.block_tables,
                meta.seq_lens,
                scale,
                sliding_window=meta.sliding_window,
                max_seq_len=meta.max_seq_len,
            )
        return paged_prefill_attention(
            q,
            kc,
            vc,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            max(meta.query_lens),
            scale,
            sliding_window=meta.sliding_window,
        )


class TritonOps:
    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: no packed GEMM on this backend's devices: out_dtype is None, x in one dtype
        out, res = fused_add_rms_norm(x, residual, weight, eps)
        return out.to(out_dtype or out.dtype), res

    def rope_tables(
        self, positions: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return positions, rotary.cos, rotary.sin

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
        positions, cos, sin = rope  # type: ignore[misc]
        rope_and_cache_kv(
            q, k, v, positions, cos, sin, cache.k[layer], cache.v[layer], slot_mapping
        )
        return q, k  # rotated in place

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
