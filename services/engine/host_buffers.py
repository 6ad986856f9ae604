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
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 2 << 20  # huge-page size: pooled buffers are whole huge pages


@dataclass(frozen=True, slots=True)
class PoolStats:
    hits: int  # takes served by a returned buffer
    misses: int  # takes that allocated
    free_bytes: int  # returned buffers kept for reuse
    in_use_bytes: int  # pooled buffers handed out and not yet returned


class HostBufferPool:
    """Hands out uninitialised 1-D uint8 host tensors of at least ``min_bytes``, reusing
    returned buffers; keeps at most ``max_free_bytes`` of returned ones (oldest dropped).

    A take reuses the smallest free buffer of at least ``n`` bytes and at most twice that
    (a small request never pins a huge buffer); else it allocates ``n`` rounded up to whole
    huge pages. Smaller takes get fresh memory (the allocator reuses small blocks anyway).
    """

    def __init__(self, max_free_bytes: int = 512 << 20, min_bytes: int = 1 << 20) -> None:
        self.max_free_bytes = max_free_bytes
        self.min_bytes = min_bytes
        self._free: list[np.ndarray] = []  # oldest first
        self._free_bytes = 0
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
            fits = [i for i, b in enumerate(self._free) if n <= b.nbytes <= 2 * n]
            if fits:
                base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
                self._free_bytes -= base.nbytes
                self._hits += 1
            else:
                base = None
                self._misses += 1
        if base is None:
            # NOTE: numpy asks the kernel for huge pages for large arrays (madvise)
            base = np.empty(-(-n // _ALIGN) * _ALIGN, dtype=np.uint8)
        with self._lock:
            self._in_use_bytes += base.nbytes
        view = base[:n]
        fin = weakref.finalize(view, self._give_back, base)
        fin.atexit = False  # NOTE: nothing to return at interpreter exit
        return torch.from_numpy(view)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            self._in_use_bytes -= base.nbytes
            self._free.append(base)
            self._free_bytes += base.nbytes
            while self._free_bytes > self.max_free_bytes:  # NOTE: oldest first
                self._free_bytes -= self._free.pop(0).nbytes

    def configure(self, max_free_bytes: int) -> None:
        """Set the bound on kept buffers (a replica's ``kv_host_buffer_mb``); drops the
        oldest kept ones beyond it now."""
        with self._lock:
            self.max_free_bytes = max_free_bytes
            while self._free_bytes > self.max_free_bytes:
                self._free_bytes -= self._free.pop(0).nbytes

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._hits, self._misses, self._free_bytes, self._in_use_bytes)

    def clear(self) -> None:
        """Drop every returned buffer (buffers in use still come back later)."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


# NOTE: one per process: received and exported KV of every transport draw from it
HOST_BUFFERS = HostBufferPool()
