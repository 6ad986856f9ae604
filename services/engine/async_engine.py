"""An engine driven by its own thread, consumed from asyncio (one per replica).

Invariants: the engine is only touched under ``lock``; every request added here has a stream
until its final output (or an error) reaches it; a consumer that stops listening aborts its
request, which frees its blocks. The lock is held for a whole step (a prefill chunk can take
seconds on CPU), so the event loop never waits for it: requests are added from a worker thread,
and ``last_stats`` (refreshed by the loop thread after every step) answers stats polls. Other
threads take the lock through a turnstile that the loop lets through between steps: a
``threading.Lock`` is not fair, and a loop that released and re-took it at once kept an add
waiting 3 steps on average, up to 7 (a handed-off request's first decode token waited with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from services.engine.engine import Engine, EngineStats
from services.engine.errors import RequestFailedError
from services.engine.kv_handle import KVHandle
from services.engine.kv_stream import KVSink
from services.engine.request import FinishReason, RequestOutput
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineStalledError(RuntimeError):
    """No output for a request within the stall deadline."""


class Turnstile:
    """``lock`` for the threads other than its owner's loop: it counts who waits, and the
    loop calls ``let_in`` between its turns, so a waiter gets the lock at the next turn's end
    (at most ``max_wait_s`` of the loop's time per turn). It has ``threading.Lock``'s surface
    (``acquire``, ``release``, a context manager), so it stands wherever the engine lock is
    handed to another component (the prefill replica's Outbox frees and reads KV under it)."""

    def __init__(self, lock: threading.Lock, max_wait_s: float = 0.05) -> None:
        self.lock = lock
        self.max_wait_s = max_wait_s
        self.waiting = 0  # threads between asking for the lock and holding it
        self._count = threading.Condition()

    def acquire(self, blocking: bool = True) -> bool:
        """A blocking acquire waits its turn; a non-blocking one takes the lock only if it is
        free now (nothing to wait for, so nothing to count)."""
        if not blocking:
            return self.lock.acquire(blocking=False)
        with self._count:
            self.waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._count:
                self.waiting -= 1
                self._count.notify_all()
        return True

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> Turnstile:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def hold(self) -> Turnstile:
        return self

    def let_in(self) -> None:
        """The loop, not holding the lock: returns once every thread waiting now has had it
        (or after ``max_wait_s``)."""
        if self.waiting:  # NOTE: a racy read; a waiter that just arrived waits one turn
            with self._count:
                self._count.wait_for(lambda: self.waiting == 0, timeout=self.max_wait_s)


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread while there is work.

    Joins: a request whose KV arrives from a prefill replica joins the batch at the end of
    the step in flight (a whole decode step later, at worst). When the last layer of a
    request's KV stream is in, its add follows within a few ms (the prefill samples its first
    token and sends the trailer: 7.7 ms p50, 13 ms p90 under the standard load), so the
    decode replica announces it (``expect``): a step ending in that window waits for the
    add, up to the expectation's deadline, and the new request joins the very next step,
    instead of a whole step after. The running requests lose at most that wait, once per
    prefill chunk that finishes prompts.

    Args:
        stall_timeout_s: longest wait for a request's next output before giving up on it.
        clock: monotonic seconds (expectations' deadlines; injected by tests).
    """

    def __init__(
        self,
        engine: Engine,
        stall_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._wake = threading.Condition(self.lock)
        self._turn = Turnstile(self.lock)
        # request id -> when to stop waiting for its add; its own lock: announced from
        # receiving threads while a step holds the engine lock
        self._expected: dict[str, float] = {}
        self._expect_lock = threading.Lock()
        self.join_waits = 0  # steps that waited for an announced add
        self.join_wait_s = 0.0  # and how long, in all
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]]] = {}
        self._stopped = False
        self.last_stats: EngineStats = engine.stats()
        self.busy_s = 0.0  # seconds spent in steps that had work (utilisation, autoscaling)
        self.last_step_end = time.monotonic()  # when the loop last finished a step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        kv_handle: KVHandle | None = None,
        kv_sink: KVSink | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; raises InvalidRequestError before yielding."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()

        # NOTE: a cancel can arrive while ``add`` waits for the engine lock (held for a whole
        # step). ``gate`` orders the two: the add skips a request already cancelled, and a
        # cancel that finds it added takes it back out (on a thread: the abort needs the lock).
        gate = threading.Lock()
        state = {"cancelled": False, "added": False}

        def add() -> None:
            with self._turn.hold(), gate:
                if state["cancelled"]:
                    return
                self.engine.add_request(
                    request_id,
                    prompt_ids,
                    params,
                    prefill_only=prefill_only,
                    kv_handle=kv_handle,
                    kv_sink=kv_sink,
                )
                self._streams[request_id] = (loop, queue)
                state["added"] = True
                with self._expect_lock:
                    self._expected.pop(request_id, None)
                self._wake.notify()

        try:
            await asyncio.to_thread(add)
        except asyncio.CancelledError:
            with gate:
                state["cancelled"] = True
                added = state["added"]
            if added:
                threading.Thread(target=self.abort, args=(request_id,), daemon=True).start()
            raise
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=self.stall_timeout_s)
                except TimeoutError:
                    raise EngineStalledError(f"request {request_id!r} made no progress") from None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                assert isinstance(item, RequestOutput)
                finished = item.finished
                yield item
        finally:
            if not finished:  # consumer went away (disconnect, cancel, error): free the blocks
                self._abort_off_loop(request_id)

    def _abort_off_loop(self, request_id: str) -> None:
        """``abort`` without making the event loop wait for the step in flight (a prefill
        chunk can take a second, and every other stream of the replica shares the loop):
        at once if the engine lock is free, else from a thread."""
        if self._turn.acquire(blocking=False):
            try:
                self._abort_locked(request_id)
            finally:
                self._turn.release()
            return
        threading.Thread(target=self.abort, args=(request_id,), daemon=True).start()

    def abort(self, request_id: str) -> None:
        with self._turn.hold():
            self._abort_locked(request_id)

    def _abort_locked(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.notify()

    def expect(self, request_id: str, within_s: float) -> None:
        """``request_id``'s add is due within ``within_s`` (its KV is all here): a step
        ending before then waits for it (see the class's note on joins). Any thread, never
        blocks; an add that does not come only costs the wait until the deadline."""
        if within_s > 0:
            with self._expect_lock:
                self._expected[request_id] = self._clock() + within_s

    def _join_wait(self) -> None:
        """Under the engine lock, between steps: while an announced add is due, wait for it
        (the wait releases the lock, so the add gets in), until the last deadline."""
        start = None
        while not self._stopped:
            now = self._clock()
            with self._expect_lock:
                for rid in [r for r, due in self._expected.items() if due <= now]:
                    del self._expected[rid]  # never came (a failed receive): no more waiting
                due = max(self._expected.values(), default=None)
            if due is None:
                break
            start = now if start is None else start
            self._wake.wait(timeout=due - now)
        if start is not None:
            self.join_waits += 1
            self.join_wait_s += self._clock() - start

    @property
    def turnstile(self) -> Turnstile:
        """The engine lock for threads other than the loop (see ``Turnstile``)."""
        return self._turn

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run ``fn(engine, *args)`` under the engine lock (stats, export, release)."""
        with self._turn.hold():
            return fn(self.engine, *args)

    def check_alive(self, stall_s: float) -> None:
        """Raises unless the loop thread runs and, when there is work, finished a step within
        ``stall_s``. Reads without the lock: a health probe must never wait behind a step."""
        if self._stopped or not self._thread.is_alive():
            raise EngineStalledError("the engine loop thread is not running")
        idle_for = time.monotonic() - self.last_step_end
        if self._streams and idle_for > stall_s:
            raise EngineStalledError(
                f"{len(self._streams)} requests open and no step finished for {idle_for:.0f} s"
            )

    def stop(self) -> None:
        with self._turn.hold():
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        orphans: list[str] = []  # requests whose consumer's event loop has closed
        while True:
            with self._wake:
                for rid in orphans:  # nobody reads them: abort (their final outputs go nowhere)
                    self.engine.abort(rid)
                    self._streams.pop(rid, None)
                orphans.clear()
                if not self._stopped and not self.engine.has_unfinished:
                    # NOTE: wake up now and then even when idle: step() also expires KV holds
                    # that no decode replica came for. The step below runs either way, and its
                    # outputs are always delivered: a wait that timed out may still return
                    # after a request was added (``add`` held the lock across the timeout),
                    # and that step then runs the request (it may even finish it).
                    self._wake.wait(timeout=1.0)
                if self.engine.has_unfinished:
                    self._join_wait()
                if self._stopped:
                    break
                working = self.engine.has_unfinished
                try:
                    t = time.perf_counter()
                    outputs = self.engine.step()
                    if working:
                        self.busy_s += time.perf_counter() - t
                except Exception as e:  # a bug: fail every open stream loudly, keep serving
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                self.last_stats = self.engine.stats()
                self.last_step_end = time.monotonic()
                deliveries = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    item = out
                    if out.finish_reason is FinishReason.ERROR:  # its consumer raises
                        item = RequestFailedError(out.error or "failed")
                    deliveries.append((stream, out.request_id, item))
            for (loop, queue), rid, item in deliveries:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # that event loop has closed (a consumer's abort may be
                    orphans.append(rid)  # still on its way): never the loop thread's end
            self._turn.let_in()

    def _fail_all(self, error: Exception) -> None:
        for rid, (loop, queue) in list(self._streams.items()):
            self.engine.abort(rid)
            with contextlib.suppress(RuntimeError):  # a consumer's event loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, error)
        self._streams.clear()
        self.engine.step()  # drain the aborts
