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


class PinnedKV(Protocol):
    """A prefilled request's blocks, kept in the engine's cache for a KV handoff until
    ``free``. Both methods are called under the engine lock (by the handoff's owner, the
    prefill replica's ``kvtransfer.outbox.Outbox``)."""

    def read(self) -> torch.Tensor:
        """A copy of the blocks, ``[num_layers, 2, num_blocks, block_size, kv_heads, row]``.
        Raises UnknownRequestError once freed (never stale data from reused blocks)."""
        ...

    def free(self) -> None:
        """Give the blocks back (full ones stay in the prefix cache); idempotent."""
        ...


class KVSink(Protocol):
    """The hooks a prefill-only request's KV handoff gives the engine (``kv_sink``). The engine
    calls them on its thread, under its lock: each must return at once (queue and notify;
    never wait for a peer). The engine keeps no handoff state of its own: what happens to the
    KV after ``prefilled`` is the sink's to decide.
    """

    @property
    def wants_layers(self) -> bool:
        """Whether ``layer_computed`` is wanted (copies are taken only then)."""
        ...

    def layer_computed(self, piece: KVPiece) -> None:
        """Layer ``piece.layer`` of positions [token_start, token_end) was just written."""
        ...

    def prefilled(self, handle: KVHandle, pinned: PinnedKV) -> bool:
        """The prefill is done. ``handle`` has no block data (``blocks`` is empty): the token
        ids with the first sampled token, hashes, logprob. Returns True to keep the blocks
        pinned until ``pinned.free()``, False to have the engine free them now (nobody will
        take them)."""
        ...

    def aborted(self, reason: str) -> None:
        """The request ended without KV to hand over (aborted, or finished at its first
        token)."""
        ...
