"""Attention over the paged KV cache, behind a small registry of backends.

The torch backend is the reference: it gathers each sequence's keys and values through its
block table and runs scaled-dot-product attention. ``triton`` is the GPU backend's slot.
Metadata is built once per step (``build_metadata``) and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One sequence's share of a step: ``num_new`` tokens starting at position ``start``."""

    start: int
    num_new: int
    block_table: Sequence[int]


@dataclass(slots=True)
class PrefillPart:
    q_start: int  # offset of this sequence's tokens in the step's flat token array
    q_end: int
    slots: torch.Tensor  # [ctx_len] slot of every context token, in position order
    mask: torch.Tensor | None  # [num_new, ctx_len] bool, True = attend; None = plain causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's k/v is written
    decode_idx: torch.Tensor | None  # [num_decode] flat indices of single-token sequences
    decode_slots: torch.Tensor | None  # [num_decode, max_ctx] slots of each context, padded
    decode_bias: torch.Tensor | None  # [num_decode, 1, max_ctx] 0 where attended, -inf at padding
    prefills: list[PrefillPart]


def build_metadata(
    spans: Sequence[SeqSpan], block_size: int, device: str, sliding_window: int | None = None
) -> AttentionMetadata:
    """Index tensors for one step whose tokens are the concatenation of ``spans``."""
    slot_mapping: list[int] = []
    decode_idx: list[int] = []
    decode_tables: list[Sequence[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillPart] = []
    offset = 0
    for s in spans:
        end = s.start + s.num_new
        table = s.block_table
        slot_mapping.extend(
            table[p // block_size] * block_size + p % block_size for p in range(s.start, end)
        )
        if s.num_new == 1:
            decode_idx.append(offset)
            decode_tables.append(table[: -(-end // block_size)])
            decode_lens.append(end)
        else:
            bt = torch.tensor(table[: -(-end // block_size)], dtype=torch.long)
            slots = (bt[:, None] * block_size + torch.arange(block_size)).flatten()[:end]
            mask = None
            if s.start > 0 or sliding_window is not None:
                q_pos = torch.arange(s.start, end)[:, None]
                k_pos = torch.arange(end)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
                mask = mask.to(device)
            prefills.append(PrefillPart(offset, offset + s.num_new, slots.to(device), mask))
        offset += s.num_new
    d_idx = d_slots = d_bias = None
    if decode_idx:
        width = max(len(t) for t in decode_tables)
        blocks = torch.tensor(
            [list(t) + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long
        )
        max_len = max(decode_lens)
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :max_len]
        lens = torch.tensor(decode_lens)
        k_pos = torch.arange(max_len)[None, :]
        mask = k_pos < lens[:, None]
        if sliding_window is not None:
            mask &= k_pos > (lens[:, None] - 1 - sliding_window)
        bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
        d_idx = torch.tensor(decode_idx, dtype=torch.long, device=device)
        d_slots = slots.contiguous().to(device)
        d_bias = bias[:, None, :].to(device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        decode_idx=d_idx,
        decode_slots=d_slots,
        decode_bias=d_bias,
        prefills=prefills,
    )


class AttentionBackend(Protocol):
    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

        The step's new keys and values are already written to ``cache``.
        """
        ...


class TorchAttention:
    """Reference backend: gather through block tables, then plain torch attention.

    Prefill uses ``F.scaled_dot_product_attention``; decode uses a grouped matmul (the
    ``heads / kv_heads`` query heads sharing a KV head form the query rows), which avoids
    both repeating KV heads and the flash kernel's poor single-query performance.
    """

    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        kflat, vflat = cache.flat(layer)  # [kv_heads, slots, head_dim]
        if meta.decode_idx is not None and not meta.prefills and len(meta.decode_idx) == q.shape[0]:
            return self._decode(q, kflat, vflat, meta)  # pure decode step: no scatter needed
        out = torch.empty_like(q)
        if meta.decode_idx is not None:
            out[meta.decode_idx] = self._decode(q[meta.decode_idx], kflat, vflat, meta)
        for p in meta.prefills:
            # NOTE: 4-D inputs: torch's CPU flash kernel only takes those (3-D falls back to the
            # quadratic-memory math path, 5x slower at 2k tokens).
            qs = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            k = kflat.index_select(1, p.slots).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
            v = vflat.index_select(1, p.slots).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True
            )
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, kflat: torch.Tensor, vflat: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_slots is not None and meta.decode_bias is not None
        b, heads, dim = q.shape
        g = kflat.shape[0]
        ctx = meta.decode_slots.shape[1]
        flat_slots = meta.decode_slots.view(-1)
        k = kflat.index_select(1, flat_slots).view(g, b, ctx, dim)  # [kv_heads, b, ctx, head_dim]
        v = vflat.index_select(1, flat_slots).view(g, b, ctx, dim)
        qg = q.view(b, g, heads // g, dim).transpose(0, 1)  # [kv_heads, b, group, head_dim]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * dim**-0.5  # [kv_heads, b, group, ctx]
        probs = torch.softmax(scores + meta.decode_bias, dim=-1)
        o = torch.matmul(probs, v)  # [kv_heads, b, group, head_dim]
        return o.transpose(0, 1).reshape(b, heads, dim)


def _load_torch() -> AttentionBackend:
    return TorchAttention()


def _load_triton() -> AttentionBackend:
    # NOTE: imported lazily so that CPU machines never import Triton.
    raise NotImplementedError(
        "attention backend 'triton' is reserved for the CUDA kernels and is not built yet; use 'torch'"
    )


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _load_torch,
    "triton": _load_triton,
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name; the error lists the valid names."""
    try:
        loader = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}"
        ) from None
    return loader()
