"""The paged KV pool: one preallocated key tensor and one value tensor per layer."""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated paged KV storage.

    Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` of a
    request lives at slot ``block_table[t // block_size] * block_size + t % block_size``.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def bytes_per_block(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t[0].numel() * t.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; slots: [num_tokens] int64."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy out blocks: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        return torch.stack(
            [torch.stack((k.index_select(0, idx), v.index_select(0, idx))) for k, v in zip(self.k, self.v)]
        )

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks`` for ``data[:, :, i]`` -> block ``block_ids[i]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        data = data.to(device=self.k[0].device, dtype=self.k[0].dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k.index_copy_(0, idx, data[layer, 0])
            v.index_copy_(0, idx, data[layer, 1])
