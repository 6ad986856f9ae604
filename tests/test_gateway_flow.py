"""The gateway's request flow against fake deployment handles (no cluster): a decode stream
that stops before its request finished is resumed (every token once) or ends in an explicit
error, never as a truncated success; a draining gateway refuses new work."""

from __future__ import annotations

import asyncio

import pytest

from services.config import ServeConfig
from services.engine.sampling_params import SamplingParams
from services.gateway.gateway import Gateway, ServiceUnavailableError, Timing
from services.pd_flow import TokenChunk


class FakeDecode:
    """The decode deployment's handle: call i of ``generate`` streams ``runs[i]`` (the last
    one again when calls outnumber runs); an exception in a run is raised at that point."""

    def __init__(self, *runs: list[TokenChunk | BaseException]) -> None:
        self.runs = runs
        self.calls: list[str] = []

    def options(self, **_: object) -> FakeDecode:
        return self

    def remote(self, spec, *_: object, **__: object) -> FakeStream:  # type: ignore[no-untyped-def]
        self.calls.append(spec.request_id)
        return FakeStream(self.runs[min(len(self.calls), len(self.runs)) - 1])


class FakeStream:
    def __init__(self, items: list[TokenChunk | BaseException]) -> None:
        self.items = items

    def __aiter__(self):  # type: ignore[no-untyped-def]
        return self._gen()

    async def _gen(self):  # type: ignore[no-untyped-def]
        for c in self.items:
            if isinstance(c, BaseException):
                raise c
            yield c

    def cancel(self) -> None:
        pass


def _gateway(*runs: list, resume_timeout_s: float = 2.0) -> Gateway:  # type: ignore[type-arg]
    cfg = ServeConfig(
        mode="colocated", routing="least_loaded", grpc_port=0, resume_timeout_s=resume_timeout_s
    )
    return Gateway(None, FakeDecode(*runs), cfg)


def T(ids: tuple[int, ...], text: str, finish: str | None = None) -> TokenChunk:
    return TokenChunk(ids, text, None, finish)


async def _collect(gw: Gateway) -> list[TokenChunk]:
    spec = gw.spec([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    return [c async for c in gw.generate(spec, Timing())]


def test_a_finished_stream_is_delivered_whole():
    done = [T((1,), "a"), T((2, 3), "bc", "length")]
    assert asyncio.run(_collect(_gateway(done))) == done


async def _into(gw: Gateway, got: list[TokenChunk]) -> None:
    spec = gw.spec([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    async for c in gw.generate(spec, Timing()):
        got.append(c)


def test_a_stream_cut_before_its_finish_is_an_error_not_a_success():
    """Regression: a decode replica killed mid-stream ended the SSE stream normally after 135
    of 200 tokens; the client could not tell it from a finished answer."""
    cut = [T((1,), "a"), T((2,), "b")]
    got: list[TokenChunk] = []
    gw = _gateway(cut, resume_timeout_s=0)  # resuming off: the cut is the end
    with pytest.raises(ServiceUnavailableError, match="ended before the request finished"):
        asyncio.run(_into(gw, got))
    assert got == cut  # what came is delivered; then the explicit error


def test_a_cut_stream_resumes_and_every_token_arrives_once():
    from ray.exceptions import ActorDiedError

    full = [T((1,), "a"), T((2,), "b"), T((3,), "c"), T((4,), "d", "length")]
    gw = _gateway(
        [full[0], full[1], ActorDiedError()],  # the replica dies after two tokens
        [full[0], full[1]],  # then a replay cut without a finish reason
        full,  # then a whole replay
    )
    got: list[TokenChunk] = []
    asyncio.run(_into(gw, got))
    assert [t for c in got for t in c.token_ids] == [1, 2, 3, 4]
    assert "".join(c.text for c in got) == "abcd" and got[-1].finish_reason == "length"
    calls = gw.decode.calls
    assert len(calls) == 3 and len(set(calls)) == 3  # each run under a fresh request id
    assert gw.metrics.resumes._value.get() == 2


def test_a_replay_that_disagrees_is_an_error_not_a_splice():
    gw = _gateway([T((1,), "a"), T((2,), "b")], [T((1,), "a"), T((9,), "z"), T((3,), "c", "stop")])
    got: list[TokenChunk] = []
    with pytest.raises(ServiceUnavailableError, match="did not replay"):
        asyncio.run(_into(gw, got))
    assert [t for c in got for t in c.token_ids] == [1, 2]


def test_a_request_error_is_not_resumed():
    from services.engine.errors import RequestFailedError

    gw = _gateway([T((1,), "a"), RequestFailedError("sampling failed")])
    with pytest.raises(RequestFailedError):
        asyncio.run(_into(gw, []))
    assert len(gw.decode.calls) == 1


def test_a_draining_gateway_refuses_new_requests_and_is_not_ready():
    gw = _gateway([T((1,), "a", "stop")])
    gw.drain()
    with pytest.raises(ServiceUnavailableError, match="shutting down"):
        asyncio.run(_collect(gw))
    assert asyncio.run(gw.readiness.check()) == (False, "draining: the server is shutting down")
    assert gw.inflight() == 0


def test_a_stream_past_its_deadline_ends_with_an_error_and_its_source_is_cancelled():
    from services.gateway.gateway import _with_deadline

    stuck = asyncio.Event()  # never set: the source hangs after two items
    cancelled: list[bool] = []

    async def source():  # type: ignore[no-untyped-def]
        yield 1
        yield 2
        try:
            await stuck.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def finite():  # type: ignore[no-untyped-def]
        for i in range(3):
            yield i

    async def run(gen, timeout_s):  # type: ignore[no-untyped-def]
        got = []
        try:
            async for item in _with_deadline(gen, timeout_s):
                got.append(item)
        except ServiceUnavailableError as e:
            got.append(str(e))
        return got

    assert asyncio.run(run(finite(), 30.0)) == [0, 1, 2]
    assert asyncio.run(run(source(), 0.2)) == [1, 2, "the request passed its deadline"]
    assert cancelled == [True]
