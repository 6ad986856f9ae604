"""PullBudget: a decode replica's KV pulls wait while earlier ones hold the byte budget or
the engine's free blocks; nothing in flight admits anything (no deadlock)."""

from __future__ import annotations

import asyncio

from services.decode.pull_budget import PullBudget


async def _until(cond, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``cond`` on the event loop until it holds (the one deadline helper here)."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def _enter(budget: PullBudget, nbytes: int, nblocks: int, into: list[str], tag: str) -> None:
    async with budget.hold(nbytes, nblocks):
        into.append(tag)


def test_a_pull_waits_for_bytes_and_an_early_release_lets_the_next_in():
    async def main() -> list[str]:
        budget = PullBudget(100, lambda: 1000)
        order: list[str] = []
        release_first = asyncio.Event()

        async def first() -> None:
            async with budget.hold(80, 1) as imported:
                order.append("first in")
                await release_first.wait()
                imported()  # its KV is in the cache: the share goes back before it ends
                await _until(lambda: "second in" in order)
                order.append("first done")

        a = asyncio.create_task(first())
        await _until(lambda: order == ["first in"])
        b = asyncio.create_task(_enter(budget, 50, 1, order, "second in"))  # 80 + 50 > 100
        await _until(lambda: budget.waiting == 1)
        assert order == ["first in"]
        release_first.set()
        await asyncio.gather(a, b)
        assert budget.bytes == 0 and budget.blocks == 0
        return order

    assert asyncio.run(main()) == ["first in", "second in", "first done"]


def test_blocks_promised_count_against_the_engines_free_blocks():
    async def main() -> None:
        free = {"n": 10}
        budget = PullBudget(1 << 30, lambda: free["n"])
        got: list[str] = []
        async with budget.hold(1, 8):
            task = asyncio.create_task(_enter(budget, 1, 4, got, "in"))  # 8 + 4 > 10 free
            await _until(lambda: budget.waiting == 1)
            assert got == []
            free["n"] = 20  # other requests finished: now it fits
            await asyncio.wait_for(task, 5)
        assert got == ["in"]

    asyncio.run(main())


def test_an_oversized_pull_runs_alone():
    async def main() -> None:
        got: list[str] = []
        await asyncio.wait_for(_enter(PullBudget(10, lambda: 0), 1000, 50, got, "in"), 5)
        assert got == ["in"]

    asyncio.run(main())
