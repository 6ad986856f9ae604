"""What a prefill-only engine hands to a decode-only engine: a request's KV blocks and layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class LayoutFingerprint:
    """Everything that must agree for KV blocks to mean the same on two engines."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def describe_mismatch(self, other: LayoutFingerprint) -> str:
        diffs = [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs)


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A request's KV state after prefill.

    ``blocks`` is ``[num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]``
    and covers the first ``num_computed`` tokens of ``token_ids`` (the prompt); the last entry
    of ``token_ids`` is the first sampled token, whose KV the decode side computes.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_computed: int
    fingerprint: LayoutFingerprint
    block_hashes: tuple[BlockHash, ...]
    blocks: torch.Tensor
    first_logprob: float | None = None

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[2]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()
