"""One local Ray cluster (and Serve on one HTTP port) for every test of this package; it is
shut down when the package is done, before tests/test_launcher.py starts its own."""

from __future__ import annotations

import json

import httpx
import pytest

from services import data_plane
from tests.fixtures import free_port

PORT = 18431
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
RAY_METRICS_PORT = free_port()  # Ray's own metrics export (replicas' Prometheus series)


@pytest.fixture(scope="package")
def ray_serve():
    import ray
    from ray import serve

    ray.init(
        num_cpus=2,
        resources={"prefill_pool": 8, "decode_pool": 8},
        include_dashboard=False,
        log_to_driver=False,
        # NOTE: the product's default Serve data plane (services.launcher.ray_runtime_env)
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **data_plane.ENV["grpc"]}},
        _metrics_export_port=RAY_METRICS_PORT,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    yield serve
    serve.shutdown()
    ray.shutdown()


def deploy(apps: dict[str, tuple[str, dict]]) -> None:
    """Deploy ``{name: (route_prefix, config overrides)}`` and wait until each answers."""
    from ray import serve

    from services.app import build_app
    from services.config import load_config
    from tests.fixtures import wait_until_ok

    for name, (prefix, over) in apps.items():
        # NOTE: fp32 unless an app names its dtype: the token checks compare with fp32
        # references and rely on the cpu backend's batch invariance, and ``auto`` is bf16
        # (the torch backend) on hosts with native bf16
        cfg = load_config(overrides={"grpc_port": 0, "dtype": "float32", **over}, environ={})
        serve.run(build_app(cfg), name=name, route_prefix=prefix or "/", blocking=False)
    for prefix, _ in apps.values():
        wait_until_ok(f"{BASE}{prefix}/health", 300)


def undeploy(names) -> None:  # type: ignore[no-untyped-def]
    from ray import serve

    for name in names:
        serve.delete(name)


def replica_stats(app: str, deployment: str, n_replicas: int) -> dict[str, object]:
    """``ReplicaInfo`` of every replica of a deployment, by identity. The router sends these
    calls to the replica with the fewest running requests (ties at random), as its last
    report says; reports refresh every ``routing_stats_period_s``, so keep asking a while."""
    import time

    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict[str, object] = {}
    deadline = time.monotonic() + 30
    while len(seen) < n_replicas and time.monotonic() < deadline:
        info = handle.replica_stats.remote().result()
        seen[info.identity] = info
        time.sleep(0.02)
    assert len(seen) == n_replicas
    return seen


def complete(body, stream=False, prefix=""):  # type: ignore[no-untyped-def]
    """POST /v1/completions; returns (token ids, the JSON body or None when streamed)."""
    body = {"model": MODEL, **body, "stream": stream}
    if not stream:
        r = httpx.post(f"{BASE}{prefix}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()
    ids = []
    with httpx.stream("POST", f"{BASE}{prefix}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    ids.extend(ch["token_ids"])
    return ids, None
