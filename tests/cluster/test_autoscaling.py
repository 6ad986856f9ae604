"""SLO autoscaling on a real local cluster (min 1, max 2 replicas per pool, short windows): a
load step that pushes TTFT over its target grows the prefill pool to 2 replicas while the
decode pool, within its ITL target, stays at 1; when the load stops the prefill pool returns
to 1."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.cluster.conftest import BASE, MODEL, RAY_METRICS_PORT, deploy, undeploy

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APP, PREFIX = "auto", "/auto"
SHORT = {  # windows and delays of seconds, so the test runs in about two minutes
    "min_replicas": 1,
    "max_replicas": 2,
    "up_delay_s": 1.0,
    "up_cooldown_s": 5.0,
    "down_delay_s": 3.0,
    "down_cooldown_s": 8.0,
    "idle_s": 4.0,
    "window_s": 4.0,
    "busy_window_s": 6.0,
    "metrics_interval_s": 0.5,
    "look_back_s": 1.0,
}


@pytest.fixture(scope="module")
def autoscaled(ray_serve):
    prefill = {"num_kv_blocks": 512, "autoscaling": {"target_s": 0.5, **SHORT}}
    # ITL target far above what decode needs here: that pool must not move
    decode = {"num_kv_blocks": 512, "autoscaling": {"target_s": 5.0, **SHORT}}
    deploy({APP: (PREFIX, {"prefill": prefill, "decode": decode})})
    yield
    undeploy([APP])


def _running(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def _load(stop: threading.Event, errors: list[str], worker: int) -> None:
    n = 0
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            # a fresh prompt every time (no prefix hits): ~300 tokens of prefill each
            prompt = f"Request {worker}-{n}: " + "the quick brown fox jumps over the lazy dog " * 30
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = http.post(f"{BASE}{PREFIX}/v1/completions", json=body)
            if r.status_code != 200:
                errors.append(r.text)
            n += 1


def test_a_ttft_miss_grows_prefill_only_and_it_shrinks_back(autoscaled):
    assert (_running("prefill"), _running("decode")) == (1, 1)
    stop, errors = threading.Event(), []
    workers = [threading.Thread(target=_load, args=(stop, errors, i)) for i in range(4)]
    for w in workers:
        w.start()
    decode_seen = set()
    try:
        deadline = time.monotonic() + 240
        while _running("prefill") < 2:
            decode_seen.add(_running("decode"))
            assert time.monotonic() < deadline, "the prefill pool did not grow"
            time.sleep(0.5)
        for _ in range(10):  # the pools under load for a few more seconds
            decode_seen.add(_running("decode"))
            time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors[:2]
    assert decode_seen == {1}  # ITL within target: decode never scaled
    deadline = time.monotonic() + 180
    while _running("prefill") > 1:
        assert time.monotonic() < deadline, "the prefill pool did not shrink back"
        time.sleep(0.5)
    assert _running("decode") == 1


def _series(text: str, name: str, deployment: str) -> float:
    """Sum of a metric's samples for one deployment of this app in Prometheus text."""
    total, found = 0.0, False
    for line in text.splitlines():
        mine = f'application="{APP}"' in line and f'deployment="{deployment}"' in line
        if line.startswith(name) and mine:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} for {deployment} not exported"
    return total


def test_replica_metrics_reach_rays_export_and_the_gateway_serves_its_own(autoscaled):
    body = {"model": MODEL, "prompt": "Metrics, please:", "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(f"{BASE}{PREFIX}/v1/completions", json=body, timeout=120).status_code == 200
    url = f"http://127.0.0.1:{RAY_METRICS_PORT}/metrics"
    deadline = time.monotonic() + 60  # Ray exports every few seconds
    while True:
        text = httpx.get(url, timeout=30).text
        try:
            assert _series(text, "ray_pdserve_replica_ttft_seconds_count", "prefill") >= 1
            # 6 tokens: the first from prefill, 5 decoded, of which 4 gaps between decode
            # steps (the first waited for the KV pull, which is not ITL)
            assert _series(text, "ray_pdserve_replica_itl_seconds_count", "decode") >= 4
            assert _series(text, "ray_pdserve_replica_kv_transfer_bytes_sum", "decode") > 0
            assert _series(text, "ray_pdserve_replica_prefill_seconds_count", "prefill") >= 1
            for gauge in ("kv_blocks_free", "running_requests", "prefill_tokens_queued"):
                _series(text, f"ray_pdserve_replica_{gauge}", "decode")
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    gw = httpx.get(f"{BASE}{PREFIX}/metrics", timeout=30).text
    for name in (
        "pdserve_ttft_seconds_bucket",
        "pdserve_itl_seconds_bucket",
        "pdserve_kv_transfer_bytes_bucket",
        "pdserve_gateway_inflight_requests",
        "pdserve_prefix_hit_rate",
    ):
        assert name in gw, name
