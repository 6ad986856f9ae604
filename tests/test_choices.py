"""Several choices in one response: the merged token flows (``services.gateway.choices``)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.choices import MergedFlows, choice_seed
from services.pd_flow import TokenChunk


def _chunk(i: int) -> TokenChunk:
    return TokenChunk((i,), str(i), None, None)


class Flow:
    """A token flow that records when it started and whether it was closed."""

    def __init__(self, tokens: list[int], log: list[str], name: str, fail_at: int = -1) -> None:
        self.tokens, self.log, self.name, self.fail_at = tokens, log, name, fail_at
        self.closed = False

    async def _gen(self):  # type: ignore[no-untyped-def]
        self.log.append(f"start {self.name}")
        try:
            for k, t in enumerate(self.tokens):
                if k == self.fail_at:
                    raise RuntimeError(f"{self.name} failed")
                await asyncio.sleep(0)  # NOTE: a yield point, not a wait on time
                yield _chunk(t)
        finally:
            self.closed = True

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._gen()


async def _collect(flows, leaders):  # type: ignore[no-untyped-def]
    merged = MergedFlows(flows, leaders)
    await merged.start()
    out: dict[int, list[int]] = {}
    try:
        async for j, c in merged:
            out.setdefault(j, []).extend(c.token_ids)
    finally:
        await merged.aclose()
    return out


def test_each_choice_arrives_whole_and_in_order_and_followers_start_after_leaders():
    log: list[str] = []
    flows = [Flow(list(range(10 * j, 10 * j + 5)), log, f"f{j}") for j in range(4)]
    out = asyncio.run(_collect(flows, leaders=[0, 2]))
    assert out == {j: list(range(10 * j, 10 * j + 5)) for j in range(4)}
    assert set(log[:2]) == {"start f0", "start f2"}  # the prompts' first choices run ahead
    assert all(f.closed for f in flows)


def test_a_failure_in_one_choice_ends_the_stream_and_closes_every_flow():
    log: list[str] = []
    flows = [Flow([1, 2, 3, 4], log, "a"), Flow([5, 6, 7, 8], log, "b", fail_at=2)]
    with pytest.raises(RuntimeError, match="b failed"):
        asyncio.run(_collect(flows, leaders=[0]))
    assert all(f.closed for f in flows)


def test_a_refusal_before_the_first_token_closes_the_others():
    log: list[str] = []
    flows = [Flow([1, 2], log, "a"), Flow([3], log, "b", fail_at=0)]

    async def start() -> None:
        await MergedFlows(flows, leaders=[0]).start()

    with pytest.raises(RuntimeError, match="b failed"):
        asyncio.run(start())
    assert all(f.closed for f in flows)


def test_a_leader_holding_a_slot_the_followers_need_does_not_stall_them():
    """Each flow holds one call slot (a replica's max_ongoing_requests of 1) until it ends: a
    leader left suspended after its first chunk would keep it from its followers forever."""
    slot = asyncio.Semaphore(1)

    async def flow(tokens: list[int]):  # type: ignore[no-untyped-def]
        async with slot:
            for t in tokens:
                await asyncio.sleep(0)
                yield _chunk(t)

    async def run() -> dict[int, list[int]]:
        return await asyncio.wait_for(
            _collect([flow([1, 2, 3]), flow([4, 5]), flow([6])], leaders=[0]), timeout=10
        )

    assert asyncio.run(run()) == {0: [1, 2, 3], 1: [4, 5], 2: [6]}


@pytest.mark.parametrize("fail_at", [-1, 0, 2])
def test_a_single_flow_is_read_in_the_readers_task_whole_or_up_to_its_error(fail_at):
    log: list[str] = []
    flow = Flow([1, 2, 3], log, "a", fail_at=fail_at)
    tasks: set[asyncio.Task] = set()

    async def collect() -> dict[int, list[int]]:
        merged = MergedFlows([flow], leaders=[0])
        await merged.start()
        out: dict[int, list[int]] = {}
        try:
            async for j, c in merged:
                tasks.add(asyncio.current_task())  # type: ignore[arg-type]
                out.setdefault(j, []).extend(c.token_ids)
        finally:
            await merged.aclose()
        assert len(asyncio.all_tasks()) == 1  # no pump task beside the reader
        return out

    if fail_at < 0:
        assert asyncio.run(collect()) == {0: [1, 2, 3]}
        assert len(tasks) == 1
    else:
        with pytest.raises(RuntimeError, match="a failed"):
            asyncio.run(collect())
    assert flow.closed


def test_choice_seeds_differ_and_repeat():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
