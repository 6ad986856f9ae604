"""Readiness (services.gateway.readiness) and replica liveness (AsyncEngine.check_alive)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from services.engine.async_engine import AsyncEngine, EngineStalledError
from services.engine.engine import Engine
from services.gateway.readiness import Readiness


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ready_only_when_every_pool_runs_a_replica_and_not_draining():
    counts = {"prefill": 0, "decode": 1}
    calls = []

    def replicas() -> dict[str, int]:
        calls.append(1)
        return dict(counts)

    clock = Clock()
    r = Readiness(["prefill", "decode"], replicas, ttl_s=1.0, clock=clock)
    assert asyncio.run(r.check()) == (False, "no running replica yet in: prefill")
    counts["prefill"] = 2
    assert asyncio.run(r.check())[0] is False  # the answer is reused within ttl_s
    clock.t = 1.5
    assert asyncio.run(r.check()) == (True, "")
    assert len(calls) == 2
    r.drain()
    assert asyncio.run(r.check()) == (False, "draining: the server is shutting down")


def test_an_unreachable_controller_is_not_ready_and_says_why():
    def broken() -> dict[str, int]:
        raise ConnectionError("GCS down")

    ok, why = asyncio.run(Readiness(["decode"], broken).check())
    assert not ok and "GCS down" in why


def test_check_alive_fails_a_dead_loop_and_a_stalled_one(make_engine: Callable[..., Engine]):
    eng = make_engine()
    ae = AsyncEngine(eng, stall_timeout_s=30.0)
    try:
        ae.check_alive(60.0)  # idle and running: healthy
        with ae.lock:  # (the loop cannot step meanwhile; check_alive never takes the lock)
            ae._streams["open"] = (None, None)  # type: ignore[assignment]
            ae.last_step_end -= 120  # a request open and no step for two minutes
            with pytest.raises(EngineStalledError, match="no step finished"):
                ae.check_alive(60.0)
            ae._streams.clear()
    finally:
        ae.stop()
    with pytest.raises(EngineStalledError, match="not running"):
        ae.check_alive(60.0)
