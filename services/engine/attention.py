"""Attention over the paged KV cache: the step's metadata and the torch reference backend.

One ``AttentionMetadata`` describes a step for every layer and every backend, in the layout
paged kernels take (FlashAttention varlen / vLLM style): a row of the block table, the total
context length and the query range of each sequence. Its tensors live on the engine's device
and are built from persistent device state (``services.engine.step_state``); the host keeps
O(num_seqs) copies of the lengths for launch grids and for the reference backend's split.

The torch backend is the reference: it gathers each sequence's keys and values through its
block table and runs scaled-dot-product attention. The Triton backend
(``services.engine.triton_backend``) consumes the same metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
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
class AttentionMetadata:
    """A step's sequences, as every layer's attention sees them.

    Invariant: sequence i owns query rows ``[query_start_loc[i], query_start_loc[i+1])``, whose
    positions are ``context_lens[i] - query_lens[i]`` onwards; their keys and values are in the
    cache (written by the layer) before attention runs.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's k/v goes to
    block_tables: torch.Tensor  # [num_seqs, width] int32: block ids, padded past the end
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    query_lens: list[int]  # host copies, O(num_seqs)
    context_lens: list[int]
    block_size: int
    sliding_window: int | None = None
    # upper bound of context_lens that kernel grids are sized by; under CUDA graphs it is the
    # engine's max_model_len, so one captured launch serves every replay
    max_seq_len: int = 0
    # sequence i's new tokens are all prompt positions (a prefill chunk, or what a prefix-cache
    # hit left of a prompt); None: not known, every span is routed by its length alone
    prompt_spans: list[bool] | None = None
    plan: object | None = None  # the backend's once-per-step precomputation (see prepare)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_pure_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def build_metadata(
    spans: Sequence[SeqSpan], block_size: int, device: str, sliding_window: int | None = None
) -> AttentionMetadata:
    """Metadata from explicit block tables (tests, tools). The engine builds the same thing
    from its persistent device tables instead (``StepState``)."""
    width = max(-(-(s.start + s.num_new) // block_size) for s in spans)
    tables = torch.zeros((len(spans), width), dtype=torch.int32)
    slots: list[int] = []
    for i, s in enumerate(spans):
        n = -(-(s.start + s.num_new) // block_size)
        tables[i, :n] = torch.tensor(list(s.block_table[:n]), dtype=torch.int32)
        t = s.block_table
        slots.extend(
            t[p // block_size] * block_size + p % block_size
            for p in range(s.start, s.start + s.num_new)
        )
    q_lens = [s.num_new for s in spans]
    ctx = [s.start + s.num_new for s in spans]
    qsl = torch.zeros(len(spans) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        query_lens=q_lens,
        context_lens=ctx,
        block_size=block_size,
        sliding_window=sliding_window,
        max_seq_len=max(ctx),
    )


class AttentionBackend(Protocol):
    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the first layer: precompute what every layer shares."""
        ...

    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

        The step's new keys and values are already written to ``cache``.
        """
        ...


@dataclass(slots=True)
class _DecodePlan:
    rows: torch.Tensor | None  # [num_decode] flat token rows; None = every row of the step
    slots: torch.Tensor  # [num_decode, max_ctx] slot of each context position, padded
    bias: torch.Tensor  # [num_decode, 1, max_ctx] fp32: 0 where attended, -inf elsewhere


@dataclass(slots=True)
class _PrefillPart:
    q_start: int  # offset of this sequence's tokens in the step's flat token array
    q_end: int
    slots: torch.Tensor  # [ctx_len] slot of every context token, in position order
    mask: torch.Tensor | None  # [num_new, ctx_len] bool, True = attend; None = plain causal


@dataclass(slots=True)
class _TorchPlan:
    decode: _DecodePlan | None
    prefills: list[_PrefillPart]


def _slots(tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[n, width] block ids -> [n, length] slot of every position (length <= width * bs)."""
    offs = torch.arange(block_size, device=tables.device)
    return (tables.long()[:, :, None] * block_size + offs).flatten(1)[:, :length]


class TorchAttention:
    """Reference backend: gather through block tables, then plain torch attention.

    Prefill uses ``F.scaled_dot_product_attention``; decode uses a grouped matmul (the
    ``heads / kv_heads`` query heads sharing a KV head form the query rows), which avoids
    both repeating KV heads and the flash kernel's poor single-query performance.

    ``prompt_dtype``: prefill attention casts queries, keys and values to it and its output
    back (bf16 under fp32 activations on a CPU with AMX: SDPA's flash kernel runs 2.2x faster
    there; ``precision.prompt_attention_dtype``); None computes in the cache's dtype.
    """

    def __init__(self, prompt_dtype: torch.dtype | None = None) -> None:
        self.prompt_dtype = prompt_dtype

    def prepare(self, meta: AttentionMetadata) -> None:
        bs, window = meta.block_size, meta.sliding_window
        dec = [i for i, n in enumerate(meta.query_lens) if n == 1]
        decode = None
        if dec:
            every = len(dec) == meta.num_seqs
            idx = None if every else torch.tensor(dec, device=meta.block_tables.device)
            tables = meta.block_tables if idx is None else meta.block_tables[idx]
            lens = meta.seq_lens if idx is None else meta.seq_lens[idx]
            max_len = max(meta.context_lens[i] for i in dec)
            k_pos = torch.arange(max_len, device=tables.device)[None, :]
            mask = k_pos < lens[:, None]
            if window is not None:
                mask &= k_pos > (lens[:, None] - 1 - window)
            bias = torch.zeros(mask.shape, device=tables.device).masked_fill_(~mask, -torch.inf)
            rows = None if idx is None else meta.query_start_loc[idx].long()
            decode = _DecodePlan(rows, _slots(tables, bs, max_len), bias[:, None, :])
        prefills = []
        starts = meta.query_start_loc.tolist() if len(dec) < meta.num_seqs else []
        for i, n in enumerate(meta.query_lens):
            if n == 1:
                continue
            end = meta.context_lens[i]
            start = end - n
            slots = _slots(meta.block_tables[i : i + 1], bs, end)[0]
            mask = None
            if start > 0 or window is not None:
                q_pos = torch.arange(start, end, device=slots.device)[:, None]
                k_pos = torch.arange(end, device=slots.device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            prefills.append(_PrefillPart(starts[i], starts[i] + n, slots, mask))
        meta.plan = _TorchPlan(decode, prefills)

    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        plan = meta.plan
        assert isinstance(plan, _TorchPlan), "prepare(meta) runs once per step, before forward"
        if plan.decode is not None and plan.decode.rows is None:
            return self._decode(q, cache, layer, plan.decode)  # pure decode: no scatter needed
        out = torch.empty_like(q)
        if plan.decode is not None:
            rows = plan.decode.rows
            out[rows] = self._decode(q[rows], cache, layer, plan.decode)
        for p in plan.prefills:
            # NOTE: 4-D inputs: torch's CPU flash kernel only takes those (3-D falls back to the
            # quadratic-memory math path, 5x slower at 2k tokens).
            qs = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            k, v = cache.gather(layer, p.slots)  # [kv_heads, ctx, head_dim]
            if self.prompt_dtype is not None:
                qs, k, v = (t.to(self.prompt_dtype) for t in (qs, k, v))
            o = F.scaled_dot_product_attention(
                qs, k.unsqueeze(0), v.unsqueeze(0), attn_mask=p.mask, is_causal=p.mask is None,
                enable_gqa=True,
            )  # fmt: skip
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)  # (cast back to out's dtype)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, cache: KVCache, layer: int, plan: _DecodePlan) -> torch.Tensor:
        b, heads, dim = q.shape
        ctx = plan.slots.shape[1]
        k, v = cache.gather(layer, plan.slots.reshape(-1))
        g = k.shape[0]
        k = k.view(g, b, ctx, dim)  # [kv_heads, b, ctx, head_dim]
        v = v.view(g, b, ctx, dim)
        qg = q.view(b, g, heads // g, dim).transpose(0, 1)  # [kv_heads, b, group, head_dim]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * dim**-0.5  # [kv_heads, b, group, ctx]
        # NOTE: softmax in fp32 whatever the model dtype (the bias is fp32); the probabilities
        # go back to the cache dtype for the product with v, as SDPA does in bf16/fp16.
        probs = torch.softmax(scores.float() + plan.bias, dim=-1).to(v.dtype)
        o = torch.matmul(probs, v)  # [kv_heads, b, group, head_dim]
        return o.transpose(0, 1).reshape(b, heads, dim)
