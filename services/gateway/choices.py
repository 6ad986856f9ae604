"""Several choices in one response (``n`` > 1, a batch of prompts): one token flow per choice,
merged into one stream of ``(choice index, chunk)``.

Invariants:
- The first choice of each prompt runs ahead: the others start once it has its first token,
  so they find the prompt's full KV blocks in the prefix cache (prefix-aware routing sends
  them to the replica that holds them) instead of computing the prompt n times over.
- Every flow's first chunk is awaited before the response starts, so a refusal (overload, a
  prompt too long) is still a status code, never a 200 that then fails.
- A failure in any flow ends the whole merged stream with that error; closing the merged
  stream closes every flow (their admission slots, their replicas' work).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from services.pd_flow import TokenChunk

_END = object()


class MergedFlows:
    """``(index, chunk)`` from several flows, each flow's chunks in order.

    NOTE: every flow is drained by its own task from its first chunk on, into an unbounded
    queue (read-ahead is bounded by max_tokens): a flow left suspended after its first chunk
    holds its replicas' call slots, and followers waiting for those slots would deadlock.
    A single flow (the common request: one prompt, n = 1) has no followers: it is read in the
    reader's own task, without the task and the queue's hop per token.
    """

    def __init__(
        self,
        flows: Sequence[AsyncIterator[TokenChunk]],
        leaders: Sequence[int],
        isolate: Callable[[], None] | None = None,
    ) -> None:
        """``leaders``: the flows to start first (each prompt's first choice); the rest start
        once every leader has its first chunk. ``isolate``: run first in every flow's task but
        the first (``Gateway.isolate_calls``: its own Ray Serve request id for its calls)."""
        self._isolate = isolate
        self._its = [f.__aiter__() for f in flows]
        self._leaders = list(leaders)
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(self._its)
        self._direct = len(self._its) == 1
        self._first: Any = None  # a direct flow's first chunk (or _END), until it is read

    async def start(self) -> None:
        """Wait for every flow's first chunk (raises the first failure, after closing every
        flow)."""
        if self._direct:
            try:
                self._first = await self._its[0].__anext__()
            except StopAsyncIteration:
                self._first = _END
            except BaseException:
                await self.aclose()
                raise
            return
        try:
            lead = [self._spawn(i) for i in self._leaders]
            await asyncio.gather(*lead)
            rest = [self._spawn(i) for i in range(len(self._its)) if i not in self._leaders]
            await asyncio.gather(*rest)
        except BaseException:
            await self.aclose()
            raise

    def _spawn(self, i: int) -> asyncio.Future[None]:
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks.append(asyncio.create_task(self._pump(i, first)))
        return first

    async def _pump(self, i: int, first: asyncio.Future[None]) -> None:
        if i and self._isolate is not None:
            self._isolate()  # NOTE: in this task's own copy of the context only
        try:
            async for chunk in self._its[i]:
                self._queue.put_nowait((i, chunk))
                if not first.done():
                    first.set_result(None)
            self._queue.put_nowait((i, _END))
            if not first.done():
                first.set_result(None)
        except asyncio.CancelledError:
            if not first.done():
                first.cancel()
            raise
        except BaseException as e:  # delivered to the reader, who ends the stream with it
            self._queue.put_nowait((i, e))
            if not first.done():
                first.set_exception(e)

    def __aiter__(self) -> MergedFlows:
        return self

    async def __anext__(self) -> tuple[int, TokenChunk]:
        if self._direct:
            item, self._first = self._first, None
            if item is None:
                item = await self._its[0].__anext__()  # NOTE: its end ends this stream
            if item is _END:
                raise StopAsyncIteration
            return 0, item
        while self._open:
            i, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return i, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        # NOTE: their ends (cancelled, or an error already delivered to the reader) collected
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for it in self._its:
            close = getattr(it, "aclose", None)
            if close is not None:
                await close()


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index`` of a request with ``seed``: seed + index (each sample its own draw,
    all reproducible); None: the gateway draws one per choice."""
    return None if seed is None else seed + index
