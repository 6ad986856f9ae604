"""Authentication, TLS and overload on a real local cluster: one bearer-token setting guards
the gRPC and HTTP APIs (health and metrics stay open), the gRPC API is served over TLS, and a
gateway at its in-flight limit refuses more work with a retry hint without disturbing the
request it is serving."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

from tests.cluster.conftest import BASE, MODEL, deploy, replica_stats, undeploy
from tests.fixtures import eventually, free_port, make_tls_certs

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP, PREFIX = "sec", "/sec"
PORT = free_port()
TARGET = f"127.0.0.1:{PORT}"
TOKEN = "correct-horse-battery-staple"
GOOD = (("authorization", f"Bearer {TOKEN}"),)
BAD = (("authorization", "Bearer guess"),)
HTTP_AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEY_B = "team-b-key-0042"


@pytest.fixture(scope="module")
def secure(ray_serve, tmp_path_factory):
    cert, key, ca = make_tls_certs(tmp_path_factory.mktemp("tls"))
    over = {
        "mode": "colocated",
        "grpc_port": PORT,
        "grpc_tls_cert": str(cert),
        "grpc_tls_key": str(key),
        "auth_token": TOKEN,
        "api_keys": {"team-b": KEY_B},
        "max_inflight_requests": 1,
        "retry_after_s": 1.5,
        "decode": {"num_kv_blocks": 256},
    }
    deploy({APP: (PREFIX, over)})
    creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    ch = grpc.secure_channel(TARGET, creds)
    grpc.channel_ready_future(ch).result(timeout=60)
    yield ch, ca
    ch.close()
    undeploy([APP])


def _generate(stub, metadata, max_tokens=6, **kw):  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest(
        text="The capital of Italy is",
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        **kw,
    )
    return [
        t for m in stub.Generate(req, metadata=metadata, timeout=120) for t in m.chunk.token_ids
    ]


def test_a_wrong_or_missing_token_is_unauthenticated_on_both_apis(secure):
    ch, _ = secure
    stub = pb_grpc.GenerationStub(ch)
    for md in ((), BAD):
        for call in (
            lambda m: _generate(stub, m),
            lambda m: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=m, timeout=30),
            lambda m: stub.ListModels(pb.ListModelsRequest(), metadata=m, timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # health probes carry no token; the status follows readiness (SERVING once the pools run)
    health = health_pb2_grpc.HealthStub(ch)
    eventually(
        lambda: (
            health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
            == health_pb2.HealthCheckResponse.SERVING
        ),
        60,
        "the gRPC health status SERVING",
        every_s=0.2,  # polling a status the server updates once a second
    )
    got = _generate(stub, GOOD)
    body = {"model": MODEL, "prompt": "The capital of Italy is", "max_tokens": 6}
    body |= {"temperature": 0, "ignore_eos": True}
    url = f"{BASE}{PREFIX}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer guess"}, {"Authorization": TOKEN}):
        r = httpx.post(url, json=body, headers=headers, timeout=120)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json=body, headers=HTTP_AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == got
    for open_path in ("/health", "/metrics"):
        assert httpx.get(f"{BASE}{PREFIX}{open_path}", timeout=30).status_code == 200


def test_plain_text_is_refused_by_the_tls_port(secure):
    with grpc.insecure_channel(TARGET) as plain, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(plain).ListModels(pb.ListModelsRequest(), metadata=GOOD, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_overload_is_refused_with_a_retry_hint_and_the_running_request_goes_on(secure):
    from pdserve.client import Client

    ch, ca = secure
    stub = pb_grpc.GenerationStub(ch)
    long = pb.GenerateRequest(
        text="Write a long essay about the sea.",
        sampling=pb.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
    )
    running = stub.Generate(long, metadata=GOOD, timeout=300)
    got = len(next(running).chunk.token_ids)  # the gateway's one slot is taken
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, GOOD)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(e.value.trailing_metadata())["retry-after-ms"] == "1500"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{BASE}{PREFIX}/v1/completions", json=body, headers=HTTP_AUTH, timeout=60)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "overloaded_error"
    # the admitted request is undisturbed
    for msg in running:
        got += len(msg.chunk.token_ids)
    assert got == 60
    # the SDK, over TLS with the token: its slot is free again (or it waits out the hint)
    with Client(TARGET, token=TOKEN, root_certificates=str(ca)) as c:
        r = c.complete("The capital of Italy is", max_tokens=6, temperature=0.0, ignore_eos=True)
    assert r.token_ids == _generate(stub, GOOD)
    metrics = httpx.get(f"{BASE}{PREFIX}/metrics", timeout=30).text
    refused = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("pdserve_gateway_overload_refusals_total")
    ]
    assert refused and float(refused[0].split()[-1]) >= 2
    (info,) = replica_stats(APP, "decode", 1).values()
    assert info.stats.num_running == 0


def test_each_tenant_has_its_own_prefix_cache(secure):
    """Two keys, two tenants: a tenant's repeated prompt hits its own cache; the same prompt
    under the other key computes from scratch and reports no cached tokens, whatever
    cache_salt it sends."""
    url = f"{BASE}{PREFIX}/v1/completions"
    prompt = " ".join(f"item {i}," for i in range(40))  # several full KV blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def cached(key: str, **extra: object) -> int:
        r = httpx.post(
            url, json=body | extra, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(TOKEN)
    assert cached(TOKEN) > 0  # the same tenant reuses its prefix
    assert cached(KEY_B) == 0  # the other tenant learns nothing
    assert cached(KEY_B, cache_salt="anything") == 0
    assert cached(KEY_B) > 0  # and then has its own copy
