"""Disaggregated serving over every CPU KV transport (grpc, shm, gloo), layer-wise and whole:
the same tokens as a single-process engine, each replica's start-up self-test names its
transport, a layer-wise stream overlaps its prefill and leaves nothing open, and a transfer
that fails is counted by reason."""

from __future__ import annotations

import pytest
from ray import serve

from tests.cluster.conftest import complete, deploy, undeploy

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TRANSPORTS = ("shm", "gloo")  # grpc layer-wise (the default): every other cluster test
APPS = {f"kv-{t}": (f"/kv-{t}", {"kv_transport": t}) for t in TRANSPORTS}
APPS["kv-whole"] = ("/kv-whole", {"kv_transport": "grpc", "kv_streaming": False})


@pytest.fixture(scope="module")
def apps(ray_serve):
    pools = {"num_kv_blocks": 256}
    deploy({n: (p, {**o, "prefill": pools, "decode": pools}) for n, (p, o) in APPS.items()})
    yield
    undeploy(list(APPS))


def test_tokens_are_identical_over_each_transport(apps, smollm_engine):
    from services.engine.sampling_params import SamplingParams

    prompt = "The three primary colours are"
    ids = smollm_engine.tokenizer.encode(prompt)
    (want,) = smollm_engine.generate(
        [ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for t in (*TRANSPORTS, "whole"):  # shm and gloo layer-wise, grpc whole pulls
        got, resp = complete(body, prefix=f"/kv-{t}")
        assert got == want, t
        assert resp["pdserve_timing"]["kv_transfer_s"] > 0, t
        streamed, _ = complete(body, stream=True, prefix=f"/kv-{t}")
        assert streamed == want, t


@pytest.mark.parametrize("t", TRANSPORTS)
def test_a_layer_wise_stream_overlaps_its_prefill(apps, smollm_engine, t):
    from services.engine.sampling_params import SamplingParams

    prefill = serve.get_deployment_handle("prefill", app_name=f"kv-{t}")
    before = prefill.kv_handoff_stats.remote().result()
    # long enough (about a second of CPU prefill) for the decode replica to attach mid-way
    ids = [(7 * i) % 20000 + 100 for i in range(700)]
    (want,) = smollm_engine.generate(
        [ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    got, resp = complete(body, prefix=f"/kv-{t}")
    assert got == want
    after = prefill.kv_handoff_stats.remote().result()
    assert after["early"] == before["early"] + 1  # received while the prefill still ran
    # released: nothing open, held or queued; this handoff ended by its release
    assert after["open"] == after["streaming"] == after["held"] == after["queued_bytes"] == 0
    assert after["ended_released"] == before["ended_released"] + 1
    assert after["spilled"] == before["spilled"]  # within the stream buffer
    assert resp["pdserve_timing"]["num_cached_tokens"] == 0


def test_whole_pulls_open_no_stream(apps):
    prefill = serve.get_deployment_handle("prefill", app_name="kv-whole")
    body = {"prompt": "Name a planet:", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    got, resp = complete(body, prefix="/kv-whole")
    assert len(got) == 3 and resp["pdserve_timing"]["kv_transfer_s"] > 0
    stats = prefill.kv_handoff_stats.remote().result()
    assert stats["early"] == stats["late"] == stats["spilled"] == stats["queued_bytes"] == 0
    assert stats["open"] == stats["held"] == 0 and stats["ended_released"] >= 1


def test_each_replica_reports_the_transport_it_tested(apps):
    for t in TRANSPORTS:
        for deployment in ("prefill", "decode"):
            h = serve.get_deployment_handle(deployment, app_name=f"kv-{t}")
            report = h.kv_self_test.remote().result()
            assert report["transport"] == t and report["gbps"] > 0 and report["bytes"] >= 1 << 20


def test_a_failed_transfer_is_counted_and_re_prefilled(apps):
    h = serve.get_deployment_handle("decode", app_name="kv-gloo")
    h.set_fail_next_pulls.remote(1).result()
    body = {"prompt": "Count to five:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    got, _ = complete(body, prefix="/kv-gloo")
    assert len(got) == 6  # the gateway re-prefilled once and the request went on
    assert h.kv_transfer_failures.remote().result().get("transfer", 0) >= 1
