"""AsyncEngine: every request's outputs reach its consumer, including a request that the loop
thread's idle step picks up; a consumer that goes away frees its request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from kvtransfer.outbox import Outbox
from services.engine.async_engine import AsyncEngine
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from tests.fixtures import eventually
from tests.kvtransfer.kv_fixtures import random_handle

PROMPT = [5, 6, 7, 8, 9, 10]


async def collect(ae: AsyncEngine, rid: str, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in ae.generate(rid, PROMPT, params):
        tokens += out.new_token_ids
    return tokens


def test_a_request_added_across_the_idle_wait_timeout_gets_its_output(
    make_engine: Callable[..., Engine],
) -> None:
    """Regression: the loop thread waits for work with a 1 s timeout and steps when it expires
    (to expire KV holds). When the wait timed out while a request was being added (``add``
    holds the lock), that step ran the request, finished it, and its output was dropped: the
    consumer waited until the stall deadline. Holding the lock across a whole timeout here
    makes that interleaving certain."""
    eng = make_engine()
    ae = AsyncEngine(eng, stall_timeout_s=10.0)
    add = eng.add_request

    def slow_add(*args, **kwargs):  # type: ignore[no-untyped-def]
        add(*args, **kwargs)
        time.sleep(1.3)  # NOTE: longer than the loop's idle wait, with the lock held

    eng.add_request = slow_add  # type: ignore[method-assign]
    try:
        time.sleep(0.1)  # the loop thread is in its idle wait
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        # NOTE: a dropped output raises EngineStalledError here (the stall deadline)
        tokens = asyncio.run(collect(ae, "r0", one))
        assert len(tokens) == 1
    finally:
        ae.stop()


def test_outputs_stream_in_order_and_a_consumer_that_leaves_frees_its_request(
    make_engine: Callable[..., Engine],
) -> None:
    eng = make_engine()
    ae = AsyncEngine(eng, stall_timeout_s=30.0)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        whole = asyncio.run(collect(ae, "a", greedy))
        assert len(whole) == 6

        async def leave_after_first() -> list[int]:
            long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            gen = ae.generate("b", PROMPT, long)
            first = await anext(gen)
            await gen.aclose()  # the consumer goes away: the request is aborted
            return first.new_token_ids

        assert asyncio.run(leave_after_first()) == whole[:1]
        eventually(
            lambda: not eng.has_unfinished and eng.blocks.num_used_blocks == 0,
            10,
            "the aborted request finished and its blocks freed",
        )
        # the engine still serves, with the same greedy tokens
        assert asyncio.run(collect(ae, "c", greedy)) == whole
    finally:
        ae.stop()


def test_a_cancel_while_waiting_for_the_engine_lock_never_runs_the_request(
    make_engine: Callable[..., Engine],
) -> None:
    """Regression: the ``await`` that adds a request sat outside the try/finally, so a cancel
    that arrived while ``add`` waited for the engine lock (held for a whole step) left the
    request running for nobody. Now the add, once it gets the lock, skips it."""
    eng = make_engine()
    ae = AsyncEngine(eng, stall_timeout_s=30.0)
    added: list[str] = []
    add = eng.add_request

    def recording_add(rid, *args, **kwargs):  # type: ignore[no-untyped-def]
        added.append(rid)
        return add(rid, *args, **kwargs)

    eng.add_request = recording_add  # type: ignore[method-assign]
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    entered, left = threading.Event(), threading.Event()  # an adder thread at / past the lock
    hold = ae._turn.hold

    @contextlib.contextmanager
    def signaling():  # type: ignore[no-untyped-def]
        entered.set()  # only other threads than the loop take the turnstile
        with hold():
            yield
        left.set()

    ae._turn.hold = signaling  # type: ignore[method-assign]

    async def cancel_while_locked() -> None:
        ae.lock.acquire()  # a long step holds the engine lock
        try:
            task = asyncio.create_task(collect(ae, "r", long))
            assert await asyncio.to_thread(entered.wait, 10)  # its add waits for the lock
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            ae.lock.release()

    try:
        asyncio.run(cancel_while_locked())
        assert left.wait(10)  # the adder got the lock and returned
        assert added == []  # it skipped the cancelled request
        assert not eng.has_unfinished and eng.blocks.num_used_blocks == 0
        # and the engine serves the next request
        assert len(asyncio.run(collect(ae, "next", SamplingParams(max_tokens=3)))) == 3
    finally:
        ae.stop()


class BusyStub:
    """An engine that is always busy; each step waits for a permit from the test."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.steps = 0
        self.added: dict[str, int] = {}
        self.has_unfinished = True

    def stats(self) -> None:
        return None

    def step(self) -> list[object]:
        self.permits.acquire()
        self.steps += 1
        return []

    def add_request(self, request_id: str, *args: object, **kwargs: object) -> None:
        self.added[request_id] = self.steps

    def abort(self, request_id: str) -> None:
        pass


def test_an_add_gets_the_lock_at_the_end_of_the_step_in_flight() -> None:
    """A busy loop releases the engine lock between steps and takes it again at once; an
    unfair lock let the loop win that race for several steps (measured: 3 on average, up to
    7), so an add waited that long. Through the turnstile the add comes in right after the
    step in flight, even with more steps ready to run."""

    stub = BusyStub()
    ae = AsyncEngine(stub)  # type: ignore[arg-type]
    ae._turn.max_wait_s = 30.0  # the guarantee, not the loop's bound on waiting for a waiter

    async def run() -> None:
        gen = ae.generate("r", PROMPT, SamplingParams(max_tokens=1))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.to_thread(eventually, lambda: ae._turn.waiting == 1, 10, "the add to wait")
        for _ in range(6):  # the step in flight, and five more ready to run back to back
            stub.permits.release()
        await asyncio.to_thread(eventually, lambda: "r" in stub.added, 10, "the add")
        stub.has_unfinished = False  # the loop goes idle, so the consumer's abort gets the lock
        for _ in range(100):
            stub.permits.release()
        first.cancel()
        with contextlib.suppress(BaseException):
            await first

    asyncio.run(run())
    assert stub.added["r"] == 1
    ae.stop()


def test_a_consumer_that_leaves_during_a_step_does_not_wait_for_it(
    make_engine: Callable[..., Engine],
) -> None:
    """The abort of a request whose consumer went away needs the engine lock, held for a
    whole step (seconds for a prefill chunk on CPU); the event loop that every other stream
    of the replica shares must not wait for it: the abort happens after the step."""
    eng = make_engine()
    ae = AsyncEngine(eng, stall_timeout_s=30.0)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    held, done = threading.Event(), threading.Event()
    timed_out: list[bool] = []

    def long_step() -> None:  # holds the engine lock until told (or 5 s)
        with ae.lock:
            held.set()
            timed_out.append(not done.wait(5))

    async def leave_while_locked() -> None:
        gen = ae.generate("b", PROMPT, long)
        await anext(gen)
        step = threading.Thread(target=long_step)
        step.start()
        assert await asyncio.to_thread(held.wait, 10)
        await gen.aclose()  # returns without the lock
        assert eng.has_unfinished  # not aborted yet: that needs the lock
        done.set()
        await asyncio.to_thread(step.join)
        assert timed_out == [False]  # the consumer's close did not wait for the step

    try:
        asyncio.run(leave_while_locked())
        eventually(
            lambda: not eng.has_unfinished and eng.blocks.num_used_blocks == 0,
            10,
            "the request aborted after the step and its blocks freed",
        )
    finally:
        ae.stop()


def test_a_kv_release_during_a_step_is_freed_at_the_end_of_the_step_in_flight() -> None:
    """A prefill replica's Outbox frees a released KV hold under the engine lock: at once if
    it is free, else from its freer thread. Handed the engine's turnstile (as the prefill
    replica does), that thread gets the lock right after the step in flight, even with more
    steps ready; with the bare lock the busy loop could keep it for several steps."""
    stub = BusyStub()
    ae = AsyncEngine(stub)  # type: ignore[arg-type]
    ae.turnstile.max_wait_s = 30.0
    freed_at: list[int] = []

    class Pinned:
        def read(self) -> torch.Tensor:
            raise AssertionError("nothing reads it")

        def free(self) -> None:
            assert ae.lock.locked(), "freed under the engine lock"
            freed_at.append(stub.steps)

    h = random_handle()
    box = Outbox(h.fingerprint, lambda: ae.turnstile)
    entry = box.open("r", h.num_computed, False)
    assert entry.prefilled(dataclasses.replace(h, blocks=torch.empty(0)), Pinned())
    eventually(ae.lock.locked, 10, "the loop to be in step 0")
    box.release("r", entry.secret)  # returns at once: the step holds the lock
    assert box.state("r") is None and freed_at == []
    eventually(lambda: ae.turnstile.waiting == 1, 10, "the freer to wait for the lock")
    for _ in range(6):  # the step in flight, and five more ready to run back to back
        stub.permits.release()
    eventually(lambda: freed_at, 10, "the free")
    assert freed_at == [1]
    stub.has_unfinished = False
    for _ in range(100):
        stub.permits.release()
    ae.stop()


def test_a_step_waits_for_an_announced_add_and_no_longer_than_its_deadline() -> None:
    """A decode replica announces a request whose KV is all in (``expect``); the step after
    the one in flight waits for its add, so it joins the very next step. An add that never
    comes holds the loop only until its deadline."""
    stub = BusyStub()
    now = [0.0]
    ae = AsyncEngine(stub, clock=lambda: now[0])  # type: ignore[arg-type]

    async def run() -> None:
        ae.expect("r", within_s=30.0)
        stub.permits.release()  # the step in flight ends ...
        for _ in range(5):  # ... and more are ready to run: the loop waits instead
            stub.permits.release()
        await asyncio.to_thread(eventually, lambda: stub.steps == 1, 10, "the step in flight")
        gen = ae.generate("r", PROMPT, SamplingParams(max_tokens=1))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.to_thread(eventually, lambda: "r" in stub.added, 10, "the add")
        await asyncio.to_thread(eventually, lambda: stub.steps == 6, 10, "the steps after it")
        first.cancel()
        with contextlib.suppress(BaseException):
            await first

    asyncio.run(run())
    assert stub.added["r"] == 1  # joined the first step after the one in flight
    assert ae.join_waits == 1
    stub.has_unfinished = False
    stub.permits.release()
    ae.stop()


def test_an_announced_add_that_never_comes_holds_the_loop_only_until_its_deadline() -> None:
    stub = BusyStub()
    ae = AsyncEngine(stub)  # type: ignore[arg-type]
    ae.expect("lost", within_s=0.2)  # its receive failed after the last layer
    for _ in range(3):
        stub.permits.release()
    eventually(lambda: stub.steps == 3, 10, "the loop to step on after the deadline")
    assert ae.join_waits == 1 and ae.join_wait_s > 0
    assert ae._expected == {}  # forgotten
    stub.has_unfinished = False
    stub.permits.release()
    ae.stop()
