"""Helpers shared by the KV transport tests: a dict-backed ``KVSource`` and random handles."""

from __future__ import annotations

import time

import torch

from services.engine.kv_handle import KVHandle, LayoutFingerprint


class DictSource:
    """A ``KVSource`` over a dict; ``delay_s`` slows every lookup (a slow sender)."""

    def __init__(self, handles: dict[str, KVHandle], delay_s: float = 0.0) -> None:
        self.handles = handles
        self.released: list[str] = []
        self.delay_s = delay_s

    def get(self, request_id: str) -> KVHandle | None:
        time.sleep(self.delay_s)
        return self.handles.get(request_id)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.handles.pop(request_id, None)


def random_handle(
    layers: int = 3,
    kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    n_blocks: int = 5,
    dtype: str = "float32",
) -> KVHandle:
    fp = LayoutFingerprint("m", layers, kv_heads, head_dim, block_size, dtype)
    g = torch.Generator().manual_seed(n_blocks * 7 + layers)
    blocks = torch.randn(layers, 2, n_blocks, block_size, kv_heads, head_dim, generator=g)
    n_tokens = n_blocks * block_size - 1
    return KVHandle(
        "r",
        tuple(range(n_tokens + 1)),
        n_tokens,
        fp,
        (b"h" * 16,) * (n_blocks - 1),
        blocks.to(getattr(torch, dtype)),
        -0.5,
    )
