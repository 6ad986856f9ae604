"""The SDK's retry and resume rules against a real gRPC server on loopback whose backend is
scripted: UNAVAILABLE / RESOURCE_EXHAUSTED before the first token are retried (the latter
after the server's hint); after it, greedy or seeded streams are resumed with the tokens the
client has, others fail; tokens, TLS and the CLI."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from pdserve import cli
from pdserve.client import AsyncClient, Client
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

from tests.fixtures import free_port, make_tls_certs

TOKENS = [1, 2, 3, 4, 5]  # one chunk each, text "a".."e"


class _Scripted(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.fail_before = 0  # calls that fail before any token
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.trailer: tuple[tuple[str, str], ...] = ()
        self.drop_after: int | None = None  # first call breaks (UNAVAILABLE) after this many
        self.calls: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []

    def Generate(self, request, context):
        self.calls.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if len(self.calls) <= self.fail_before:
            context.abort_with_status(_Status(self.fail_code, "busy", self.trailer))
        for i in range(request.resume_from, len(TOKENS)):
            if len(self.calls) == 1 and i == self.drop_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost")
            text = chr(ord("a") + i)
            yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[TOKENS[i]], text=text))
        usage = pb.Usage(prompt_tokens=4, completion_tokens=len(TOKENS))
        rid = request.request_id
        yield pb.GenerateResponse(
            summary=pb.Summary(finish_reason=pb.FINISH_REASON_LENGTH, usage=usage, request_id=rid)
        )

    def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=[len(request.text)], max_model_len=8)

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.Model(id="m")])


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata):  # type: ignore[no-untyped-def]
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _serve(servicer, creds=None):  # type: ignore[no-untyped-def]
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(servicer, srv)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = free_port()
    addr = f"127.0.0.1:{port}"
    srv.add_insecure_port(addr) if creds is None else srv.add_secure_port(addr, creds)
    srv.start()
    return srv, addr


@pytest.fixture
def server():
    servicer = _Scripted()
    srv, target = _serve(servicer)
    yield servicer, target
    srv.stop(0)


GREEDY = {"max_tokens": 5, "temperature": 0.0}


def test_unavailable_before_the_first_token_is_retried(server):
    servicer, target = server
    servicer.fail_before = 2
    with Client(target, retries=3, backoff_s=0.01) as c:
        r = c.complete("hi", max_tokens=5)
    assert len(servicer.calls) == 3 and all(not q.resume_from for q in servicer.calls)
    assert (r.token_ids, r.text, r.finish_reason) == (TOKENS, "abcde", "length")
    assert r.request_id == servicer.calls[0].request_id != ""  # the SDK named the request
    assert r.usage["completion_tokens"] == 5 and r.ttft_s is not None and len(r.itl_s) == 4
    assert r.server_timing["kv_transfer_s"] == 0.0  # zeros are reported, not dropped
    assert r.resumes == 0


def test_retries_run_out_and_the_error_surfaces(server):
    servicer, target = server
    servicer.fail_before = 5
    with Client(target, retries=1, backoff_s=0.01) as c, pytest.raises(grpc.RpcError) as e:
        c.complete("hi")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and len(servicer.calls) == 2


def test_overload_is_retried_after_the_servers_hint(server):
    servicer, target = server
    servicer.fail_before, servicer.fail_code = 1, grpc.StatusCode.RESOURCE_EXHAUSTED
    servicer.trailer = (("retry-after-ms", "300"),)
    t = time.monotonic()
    with Client(target, retries=2, backoff_s=0.0) as c:
        r = c.complete("hi", **GREEDY)
    assert time.monotonic() - t >= 0.3  # waited the hint, not the (zero) backoff
    assert r.token_ids == TOKENS and len(servicer.calls) == 2


def test_a_hint_past_the_deadline_surfaces_the_overload_at_once(server):
    servicer, target = server
    servicer.fail_before, servicer.fail_code = 1, grpc.StatusCode.RESOURCE_EXHAUSTED
    servicer.trailer = (("retry-after-ms", "60000"),)
    with Client(target) as c, pytest.raises(grpc.RpcError) as e:
        c.complete("hi", timeout=2.0)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(servicer.calls) == 1


@pytest.mark.parametrize("sampling", [GREEDY, {"max_tokens": 5, "temperature": 0.9, "seed": 3}])
def test_a_broken_stream_is_resumed_without_repeats_or_gaps(server, sampling):
    servicer, target = server
    servicer.drop_after = 2
    with Client(target, backoff_s=0.01) as c:
        stream = c.generate("hi", request_id="r-1", **sampling)
        chunks = [ch.token_ids for ch in stream]
    assert chunks == [(t,) for t in TOKENS] and stream.result.text == "abcde"
    first, resumed = servicer.calls
    assert (first.resume_from, resumed.resume_from) == (0, 2)
    assert resumed.request_id == first.request_id == "r-1"
    assert resumed.sampling == first.sampling and resumed.text == first.text
    assert stream.result.resumes == 1 and stream.result.finish_reason == "length"


def test_no_resume_for_a_sampled_unseeded_stream(server):
    servicer, target = server
    servicer.drop_after = 1

    async def main():  # the asyncio client, same rule
        async with AsyncClient(target, retries=3, backoff_s=0.01) as c:
            got = []
            with pytest.raises(grpc.RpcError) as e:
                async for chunk in c.generate("hi"):
                    got.extend(chunk.token_ids)
            return got, e.value.code()

    assert asyncio.run(main()) == ([1], grpc.StatusCode.UNAVAILABLE)  # nothing repeated
    assert len(servicer.calls) == 1


def test_async_client_resumes_too(server):
    servicer, target = server
    servicer.drop_after = 3

    async def main():
        async with AsyncClient(target, token="s3cret", backoff_s=0.01) as c:
            r = await c.complete("hi", **GREEDY)
            return r, await c.tokenize("abc"), await c.models(), await c.health()

    r, ids, models, status = asyncio.run(main())
    assert r.token_ids == TOKENS and r.resumes == 1
    assert (ids, models, status) == ([3], ["m"], "SERVING")
    assert [q.resume_from for q in servicer.calls] == [0, 3]
    assert servicer.metadata[0]["authorization"] == "Bearer s3cret"


def test_tls_with_a_private_ca(tmp_path):
    cert, key, ca = make_tls_certs(tmp_path)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    servicer = _Scripted()
    srv, target = _serve(servicer, creds)
    try:
        with Client(target, root_certificates=str(ca)) as c:
            assert c.complete("hi", **GREEDY).token_ids == TOKENS
        with Client(target, retries=0) as c, pytest.raises(grpc.RpcError) as e:
            c.complete("hi", timeout=5)  # plain text against a TLS port
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(0)


def test_cli_commands(server, capsys):
    servicer, target = server
    t = ["--target", target]
    assert cli.main(["generate", "--prompt", "hi", "--max-tokens", "5", *t]) == 0
    out, err = capsys.readouterr()
    assert out == "abcde\n" and "5 tokens (length)" in err
    assert servicer.calls[-1].sampling.temperature == 0.0  # greedy by default
    assert cli.main(["chat", "hello", "--system", "be brief", "--json", *t]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == TOKENS
    assert [m.role for m in servicer.calls[-1].chat.messages] == ["system", "user"]
    assert cli.main(["generate", "--token-ids", "7,8", "--seed", "1", *t]) == 0
    assert (
        list(servicer.calls[-1].token_ids.ids) == [7, 8] and servicer.calls[-1].sampling.seed == 1
    )
    capsys.readouterr()
    assert cli.main(["tokenize", "abcd", *t]) == 0 and capsys.readouterr().out == "[4]\n"
    assert cli.main(["models", *t]) == 0 and capsys.readouterr().out == "m\n"
    assert cli.main(["health", *t]) == 0 and capsys.readouterr().out == "SERVING\n"
    assert cli.main(["health", "--target", "127.0.0.1:1", "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
