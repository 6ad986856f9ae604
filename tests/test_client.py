"""The SDK's retry rule against a real gRPC server on loopback whose backend is scripted:
UNAVAILABLE before the first token is retried, after it is not."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from pdserve.client import AsyncClient, Client
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

from tests.fixtures import free_port


class _Scripted(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.fail_before = 0  # calls that fail UNAVAILABLE before any token
        self.fail_after_first = False  # fail UNAVAILABLE after one token
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        if self.calls <= self.fail_before:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no replica yet")
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[1], text="a"))
        if self.fail_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "lost it")
        yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[2, 3], text="bc"))
        usage = pb.Usage(prompt_tokens=4, completion_tokens=3)
        yield pb.GenerateResponse(
            summary=pb.Summary(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage, request_id="r")
        )


@pytest.fixture
def server():
    servicer = _Scripted()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, srv)
    port = free_port()
    srv.add_insecure_port(f"127.0.0.1:{port}")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


def test_unavailable_before_the_first_token_is_retried(server):
    servicer, target = server
    servicer.fail_before = 2
    with Client(target, retries=3, backoff_s=0.01) as c:
        r = c.complete("hi", max_tokens=3)
    assert servicer.calls == 3
    assert (r.token_ids, r.text, r.finish_reason, r.request_id) == ([1, 2, 3], "abc", "length", "r")
    assert r.usage["completion_tokens"] == 3 and r.ttft_s is not None and len(r.itl_s) == 1
    assert r.server_timing["kv_transfer_s"] == 0.0  # zeros are reported, not dropped


def test_retries_run_out_and_the_error_surfaces(server):
    servicer, target = server
    servicer.fail_before = 5
    with Client(target, retries=1, backoff_s=0.01) as c, pytest.raises(grpc.RpcError) as e:
        c.complete("hi")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 2


def test_no_retry_after_the_first_token(server):
    servicer, target = server
    servicer.fail_after_first = True

    async def main():  # the asyncio client, same rule
        async with AsyncClient(target, retries=3, backoff_s=0.01) as c:
            got = []
            with pytest.raises(grpc.RpcError):
                async for chunk in c.generate("hi"):
                    got.extend(chunk.token_ids)
            return got

    assert asyncio.run(main()) == [1]  # nothing repeated
    assert servicer.calls == 1
