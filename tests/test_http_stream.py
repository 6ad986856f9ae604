"""The gateway's SSE response gives its request's flow back when the client leaves: a
disconnect while a send waits used to leave the body suspended at a ``yield`` (its source,
holding the admission slot, open until garbage collection)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.responses import StreamingResponse

from services.gateway.http_api import SourceClosingResponse


async def _disconnect_mid_send(response_cls: type) -> bool:
    """Serve a two-chunk stream to a client that leaves while the first chunk is being sent;
    returns whether the source was closed once the response returned."""
    closed = asyncio.Event()
    started = asyncio.Event()

    async def source():  # type: ignore[no-untyped-def]
        try:
            yield "a"
            yield "b"
        finally:
            closed.set()

    src = source()
    first = await src.__anext__()  # the gateway starts the flow before answering

    async def body():  # type: ignore[no-untyped-def]
        yield first
        async for x in src:
            yield x

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            started.set()
        else:
            await asyncio.Event().wait()  # a slow client: the send never completes

    async def receive() -> dict:
        await started.wait()
        return {"type": "http.disconnect"}

    args = (body(), src) if response_cls is SourceClosingResponse else (body(),)
    await response_cls(*args)({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send)
    return closed.is_set()


def test_a_client_leaving_mid_send_closes_the_flow_at_once():
    assert asyncio.run(_disconnect_mid_send(SourceClosingResponse))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_plain_streaming_response_leaves_it_open_which_is_why_the_subclass_exists():
    assert not asyncio.run(_disconnect_mid_send(StreamingResponse))
