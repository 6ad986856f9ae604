"""Back-pressure for KV pulls on a decode replica.

A pulled request's KV sits in host memory from the moment the pull starts until the engine
copies it into its paged cache (the request's first step). Unbounded, a burst of handoffs
could pull far more KV than the replica has blocks for, or than its host memory holds.
``PullBudget`` admits a pull only when both fit: its bytes within ``limit_bytes`` of KV in
flight, and its blocks within the engine's free blocks minus those already promised to
pulls in flight. A pull that does not fit waits until enough earlier pulls are imported or
fail.

Invariant: with nothing in flight any pull is admitted, however large, so a request that
alone exceeds a limit still runs (the engine refuses what can never fit, by name) and the
budget can never deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


class PullBudget:
    """Args: limit_bytes: KV bytes that may be in flight at once; free_blocks: the engine's
    free KV blocks now (a snapshot; read without the engine lock)."""

    def __init__(self, limit_bytes: int, free_blocks: Callable[[], int]) -> None:
        self.limit_bytes = limit_bytes
        self._free_blocks = free_blocks
        self.bytes = 0  # in flight
        self.blocks = 0  # promised to pulls in flight
        self.waiting = 0
        self._changed = asyncio.Condition()

    def _fits(self, nbytes: int, nblocks: int) -> bool:
        if self.bytes == 0 and self.blocks == 0:
            return True
        return (
            self.bytes + nbytes <= self.limit_bytes and self.blocks + nblocks <= self._free_blocks()
        )

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int, nblocks: int) -> AsyncIterator[Callable[[], None]]:
        """Wait until the pull fits, then hold its share; yields ``release``, which gives the
        share back early (once the KV is imported); otherwise it goes back on exit."""
        async with self._changed:
            self.waiting += 1
            try:
                # NOTE: free blocks change without notice (other requests finish): re-check
                # every so often as well as on every release here
                while not self._fits(nbytes, nblocks):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=0.05)
            finally:
                self.waiting -= 1
            self.bytes += nbytes
            self.blocks += nblocks
        held = True

        async def _give_back() -> None:
            async with self._changed:
                self._changed.notify_all()

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.bytes -= nbytes
                self.blocks -= nblocks
                asyncio.get_running_loop().create_task(_give_back())

        try:
            yield release
        finally:
            release()
