"""Layer-wise KV streaming out of a prefill-only request: what the engine emits while it
computes, so a transport can send layer i while layers i+1.. are still running.

Invariant (what a receiver may rely on): after ``finish``, applying every piece in order (a
later piece over an earlier one) gives exactly the KV that ``Engine.export_kv`` would have
copied out at that moment. Pieces are copies taken on the engine thread at the moment a layer
is written, so a sender never reads the live cache and takes no engine lock. The engine sends:
- when a span starts anywhere but where the previous one ended (a prefix-cache hit on first
  admission, or a recompute after a preemption), the cached positions before it, every layer,
  read from the cache;
- after layer i of every step writes positions [a, b), those keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.kv_handle import KVHandle


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Keys and values of one layer for positions [token_start, token_end).

    ``data`` is ``[2 (k, v), token_end - token_start, num_kv_heads, head_dim]``, contiguous."""

    layer: int
    token_start: int
    token_end: int
    data: torch.Tensor


class KVSink(Protocol):
    """Where a streaming prefill puts its pieces. Called on the engine thread, under the engine
    lock: every method must return at once (queue and notify; never wait for a peer)."""

    def put(self, piece: KVPiece) -> None: ...

    def finish(self, handle: KVHandle) -> None:
        """The prefill is done; ``handle`` is the final handle *without* block data (``blocks``
        is an empty tensor): token ids with the first sampled token, hashes, logprob."""
        ...

    def fail(self, reason: str) -> None:
        """The request ended without KV to hand over (aborted, finished at its first token), or
        after ``finish`` its hold ended (released, expired): what was not sent is dropped.
        Idempotent."""
        ...
