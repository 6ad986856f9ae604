"""The public gRPC API on a real local cluster, through a real channel: the same tokens as the
HTTP API, status codes naming the bad field, health, reflection, and deadlines / cancels that
free the decode replica's blocks."""

from __future__ import annotations

import json

import grpc
import pytest
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

from tests.cluster.conftest import MODEL, complete, deploy, replica_stats, undeploy
from tests.fixtures import TcpProxy, eventually, free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP, PREFIX = "rpc", "/rpc"
PORT = free_port()
TARGET = f"127.0.0.1:{PORT}"


@pytest.fixture(scope="module")
def channel(ray_serve):
    pools = {"num_kv_blocks": 256}
    deploy({APP: (PREFIX, {"grpc_port": PORT, "prefill": pools, "decode": pools})})
    ch = grpc.insecure_channel(TARGET)
    grpc.channel_ready_future(ch).result(timeout=60)
    yield ch
    ch.close()
    undeploy([APP])


def _stream(stub, **fields):  # type: ignore[no-untyped-def]
    ids, summary = [], None
    for msg in stub.Generate(pb.GenerateRequest(**fields), timeout=300):
        if msg.WhichOneof("kind") == "chunk":
            ids.extend(msg.chunk.token_ids)
        else:
            summary = msg.summary
    return ids, summary


def _idle_decode() -> None:
    def idle() -> bool:
        (info,) = replica_stats(APP, "decode", 1).values()
        return info.stats.blocks_used == 0 and info.stats.num_running == 0

    eventually(idle, 60, "the decode replica idle (no blocks, nothing running)")


@pytest.mark.parametrize("seed", [None, 7])
def test_streamed_tokens_equal_the_http_apis(channel, seed):
    stub = pb_grpc.GenerationStub(channel)
    sampling = pb.SamplingParams(max_tokens=10, ignore_eos=True)
    body = {"prompt": "The capital of Japan is", "max_tokens": 10, "ignore_eos": True}
    if seed is None:
        sampling.temperature = 0.0
        body["temperature"] = 0
    else:
        sampling.temperature, sampling.seed = 0.8, seed
        body |= {"temperature": 0.8, "seed": seed}
    ids, summary = _stream(stub, model=MODEL, text=body["prompt"], sampling=sampling)
    want, _ = complete(body, prefix=PREFIX)
    assert ids == want and len(ids) == 10
    assert summary.finish_reason == pb.FINISH_REASON_LENGTH
    assert summary.usage.completion_tokens == 10
    assert summary.usage.prompt_tokens == len(
        stub.Tokenize(pb.TokenizeRequest(text=body["prompt"])).token_ids
    )
    assert summary.timing.first_token_s > 0 and summary.timing.e2e_s >= summary.timing.first_token_s
    assert summary.request_id


def test_bad_arguments_name_the_field(channel):
    stub = pb_grpc.GenerationStub(channel)
    cases = [
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=3)), "top_p"),
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 999999])), "prompt"),
        (pb.GenerateRequest(chat=pb.ChatMessages()), "chat.messages"),
        # a sampled, unseeded stream cannot be replayed, so it cannot be resumed
        (pb.GenerateRequest(text="hi", request_id="r", resume_from=2), "resume_from"),
        (
            pb.GenerateRequest(text="hi", resume_from=2, sampling=pb.SamplingParams(temperature=0)),
            "request_id",
        ),
        (
            pb.GenerateRequest(
                text="hi",
                request_id="r",
                resume_from=5,
                sampling=pb.SamplingParams(max_tokens=4, temperature=0),
            ),
            "resume_from",
        ),
    ]
    for req, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        assert e.value.details().startswith(field), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(model="gpt-9", text="hi"), timeout=60))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_tokenize_models_health_and_reflection(channel, smollm_engine):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = pb_grpc.GenerationStub(channel)
    got = stub.Tokenize(pb.TokenizeRequest(text="Hello, world")).token_ids
    assert list(got) == smollm_engine.tokenizer.encode("Hello, world")
    (model,) = stub.ListModels(pb.ListModelsRequest()).models
    assert model.id == MODEL and model.max_model_len > 0
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_a_deadline_or_a_cancel_aborts_and_frees_the_blocks(channel):
    stub = pb_grpc.GenerationStub(channel)
    long = pb.GenerateRequest(
        text="Tell me a long story.", sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True)
    )
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(long, timeout=3.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _idle_decode()
    call = stub.Generate(long, timeout=300)
    for n, _ in enumerate(call):
        if n == 3:
            call.cancel()
            break
    assert call.code() == grpc.StatusCode.CANCELLED
    _idle_decode()


RESUMABLE = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 0.8, "seed": 11}, id="seeded"),
]


@pytest.mark.parametrize("sampling", RESUMABLE)
def test_a_resumed_stream_continues_the_uninterrupted_one_exactly(channel, sampling):
    stub = pb_grpc.GenerationStub(channel)
    n = 20
    req = pb.GenerateRequest(
        text="Once upon a time",
        request_id="story-1",
        sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True, **sampling),
    )

    def chunks(r):  # type: ignore[no-untyped-def]
        out, summary = [], None
        for msg in stub.Generate(r, timeout=300):
            if msg.WhichOneof("kind") == "chunk":
                out.append((tuple(msg.chunk.token_ids), msg.chunk.text))
            else:
                summary = msg.summary
        return out, summary

    full, _ = chunks(req)
    assert sum(len(ids) for ids, _ in full) == n
    for k in (1, 7, n):
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(req)
        resumed.resume_from = k
        got, summary = chunks(resumed)
        # one token per chunk: the resumed stream is the original's chunks after the first k
        assert got == full[k:], k
        assert summary.usage.completion_tokens == n and summary.request_id == "story-1"
        assert summary.finish_reason == pb.FINISH_REASON_LENGTH


def test_the_sdk_resumes_a_dropped_connection(channel):
    from pdserve.client import Client

    proxy = TcpProxy(PORT)
    kw = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "timeout": 300}
    try:
        with Client(f"127.0.0.1:{proxy.port}", backoff_s=0.05) as c:
            want = c.complete("The history of Rome", **kw)
            stream = c.generate("The history of Rome", **kw)
            got: list[int] = []
            for chunk in stream:
                got.extend(chunk.token_ids)
                if len(got) == 6 and stream.result.resumes == 0:
                    proxy.drop()  # the network fails mid-stream
        assert proxy.connections == 2  # the resumed call came over a fresh connection
        assert stream.result.resumes == 1
        assert got == want.token_ids and stream.result.text == want.text
        assert stream.result.usage["completion_tokens"] == 24
    finally:
        proxy.close()
    _idle_decode()  # the broken call was aborted on the replica


def test_sdk_clients_give_the_http_apis_tokens(channel):
    import asyncio

    from pdserve.client import AsyncClient, Client

    body = {"prompt": "Water boils at", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    want, _ = complete(body, prefix=PREFIX)
    kw = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Client(TARGET) as c:
        r = c.complete(body["prompt"], timeout=120, **kw)
        assert r.token_ids == want and r.finish_reason == "length"
        assert r.ttft_s is not None and len(r.itl_s) == 7  # one token per chunk after prefill
        assert r.usage["completion_tokens"] == 8 and r.server_timing["e2e_s"] > 0
        assert c.models() == [MODEL]

    async def streamed():
        async with AsyncClient(TARGET) as c:
            return [t async for ch in c.generate(body["prompt"], **kw) for t in ch.token_ids]

    assert asyncio.run(streamed()) == want


def test_sdk_works_from_a_fresh_venv_without_torch(channel, tmp_path):
    import shutil
    import subprocess
    import venv
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    # NOTE: install from a copy: pip builds in the source folder and would leave build/ there
    src = shutil.copytree(
        repo / "client", tmp_path / "client", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    venv.EnvBuilder(with_pip=True).create(tmp_path / "v")
    py = tmp_path / "v" / "bin" / "python"
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-c",
            repo / "deploy/constraints.txt",
            src,
        ],
        check=True,
    )
    code = (
        "import importlib.util, sys; from pdserve.client import Client; "
        "assert importlib.util.find_spec('torch') is None and importlib.util.find_spec('ray') is None; "
        f"print(Client({TARGET!r}).complete('Water boils at', max_tokens=8, temperature=0.0, "
        "ignore_eos=True, timeout=120).token_ids)"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    want, _ = complete(
        {"prompt": "Water boils at", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        prefix=PREFIX,
    )
    assert out.stdout.strip() == str(want)
    # the CLI, from the same venv
    cli = [tmp_path / "v" / "bin" / "pdserve-client"]
    run = {"check": True, "capture_output": True, "text": True, "cwd": tmp_path}
    assert subprocess.run([*cli, "health", "--target", TARGET], **run).stdout == "SERVING\n"
    assert subprocess.run([*cli, "models", "--target", TARGET], **run).stdout == f"{MODEL}\n"
    gen = [*cli, "generate", "--prompt", "Water boils at", "--max-tokens", "8", "--ignore-eos"]
    out = subprocess.run([*gen, "--json", "--target", TARGET], **run)
    assert json.loads(out.stdout)["token_ids"] == want
