"""A bounded pool of large host buffers for KV that is written once and read soon: received
KV (a whole pull, a layer-wise stream, a gloo chunk run) and exported KV.

Why: such a buffer lives from a transfer until the engine copies it into its paged cache,
then dies. A fresh one faults its memory in and the kernel zeroes every page first: on this
2-core machine that was a fifth of a gRPC receiver's CPU per GB, and its slowest part
(direct compaction for huge pages stalls at random). A returned buffer is warm.

Invariant: a buffer is handed out again only after no tensor or array uses any of its
memory. ``take`` returns a tensor over a numpy *view* of the pooled buffer; the view is
referenced by the tensor's storage (``torch.from_numpy``), so it dies only when the last
tensor sharing that storage (any reshape, slice or dtype view of it) is gone, and its
finalizer returns the buffer then.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

ALIGN = 2 << 20  # huge-page size: pooled buffers are whole huge pages


def aligned(n: int) -> int:
    """``n`` rounded up to whole ``ALIGN`` units: what a new pooled buffer takes."""
    return -(-n // ALIGN) * ALIGN


T = TypeVar("T")


class FreeList(Generic[T]):
    """Spent buffers kept for reuse (any kind: numpy arrays, shared-memory segments), oldest
    first, at most ``max_bytes`` of them. Not locked: its owner's lock guards it.

    A take gets the smallest kept buffer of at least ``n`` bytes and at most
    ``max(2n, aligned(n))`` (a small request never pins a huge buffer), or None."""

    def __init__(self, size: Callable[[T], int], max_bytes: int) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.items: list[T] = []
        self.nbytes = 0

    def take(self, n: int) -> T | None:
        top = max(2 * n, aligned(n))
        fits = [i for i, b in enumerate(self.items) if n <= self.size(b) <= top]
        if not fits:
            return None
        item = self.items.pop(min(fits, key=lambda i: self.size(self.items[i])))
        self.nbytes -= self.size(item)
        return item

    def put(self, items: Iterable[T]) -> list[T]:
        """Keep ``items``; returns what no longer fits the bound (oldest first)."""
        for item in items:
            self.items.append(item)
            self.nbytes += self.size(item)
        return self.bound(self.max_bytes)

    def bound(self, max_bytes: int) -> list[T]:
        """Set the bound; returns the oldest kept buffers beyond it, dropped."""
        self.max_bytes = max_bytes
        dropped = []
        while self.nbytes > self.max_bytes:
            dropped.append(self.items.pop(0))
            self.nbytes -= self.size(dropped[-1])
        return dropped

    def drain(self) -> list[T]:
        dropped, self.items, self.nbytes = self.items, [], 0
        return dropped


@dataclass(frozen=True, slots=True)
class PoolStats:
    hits: int  # takes served by a returned buffer
    misses: int  # takes that allocated
    free_bytes: int  # returned buffers kept for reuse
    in_use_bytes: int  # pooled buffers handed out and not yet returned


class HostBufferPool:
    """Hands out uninitialised 1-D uint8 host tensors of at least ``min_bytes``, reusing
    returned buffers (``FreeList``: best fit, at most ``max_free_bytes`` kept); a new one
    is ``n`` rounded up to whole huge pages. Smaller takes get fresh memory (the allocator
    reuses small blocks anyway)."""

    def __init__(self, max_free_bytes: int = 512 << 20, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self._free: FreeList[np.ndarray] = FreeList(lambda b: b.nbytes, max_free_bytes)
        self._in_use_bytes = 0
        self._hits = self._misses = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        if n < self.min_bytes:
            return (
                torch.from_numpy(np.empty(n, dtype=np.uint8))
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
        with self._lock:
            base = self._free.take(n)
            if base is None:
                self._misses += 1
            else:
                self._hits += 1
        if base is None:
            # NOTE: numpy asks the kernel for huge pages for large arrays (madvise)
            base = np.empty(aligned(n), dtype=np.uint8)
        with self._lock:
            self._in_use_bytes += base.nbytes
        view = base[:n]
        fin = weakref.finalize(view, self._give_back, base)
        fin.atexit = False  # NOTE: nothing to return at interpreter exit
        return torch.from_numpy(view)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            self._in_use_bytes -= base.nbytes
            self._free.put([base])

    def configure(self, max_free_bytes: int) -> None:
        """Set the bound on kept buffers (a replica's ``kv_host_buffer_mb``); drops the
        oldest kept ones beyond it now."""
        with self._lock:
            self._free.bound(max_free_bytes)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._hits, self._misses, self._free.nbytes, self._in_use_bytes)


# NOTE: one per process: received and exported KV of every transport draw from it
HOST_BUFFERS = HostBufferPool()
