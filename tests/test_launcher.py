"""`pdserve serve` as a user runs it: starts its own local Ray cluster, serves, drains and stops
on SIGTERM, and stops promptly when signalled while still starting.
(Runs after the cluster tests' Ray has shut down; it ends only the processes it started.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.fixtures import eventually, free_port, wait_until_ok

pytestmark = [pytest.mark.slow, pytest.mark.integration]


TOKEN = "launcher-token-7"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _serve(tmp_path, port: int, **env: str) -> tuple[subprocess.Popen, object]:
    log = open(tmp_path / f"serve-{port}.log", "w")  # noqa: SIM115 - outlives the Popen call
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--http-port",
            str(port),
            "--grpc-port",
            str(free_port()),
            "--decode-kv-blocks",
            "256",
            "--prefill-kv-blocks",
            "256",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    return proc, log


def _stop(proc: subprocess.Popen, log) -> None:  # type: ignore[no-untyped-def]
    if proc.poll() is None:  # failed test: still stop it cleanly so it stops its Ray
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    log.close()


def test_serve_gets_ready_drains_on_sigterm_and_exits_promptly(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # NOTE: the token through the environment, as the chart gives it: the gateway reads it from
    # the environment its process inherits (it is not in its bound arguments)
    proc, log = _serve(tmp_path, port, PDSERVE_AUTH_TOKEN=TOKEN)
    try:
        wait_until_ok(f"{base}/health", 240, proc)  # liveness: the gateway answers
        wait_until_ok(f"{base}/ready", 240, proc)  # readiness: every pool has a replica
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", timeout=300, json={**body, "max_tokens": 4})
        assert r.status_code == 401  # the token is enforced
        r = httpx.post(
            f"{base}/v1/completions", timeout=300, json={**body, "max_tokens": 4}, headers=AUTH
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # a long streamed request is in flight when SIGTERM comes: it still gets every token.
        # NOTE: long enough that the drain outlasts the checks below (64 tokens took 0.5 s on
        # an AMX host, and the server had exited before /ready was asked); well inside the
        # 20 s shutdown grace on the slowest CI kind (about 50 ms a token under load)
        with httpx.stream(
            "POST", f"{base}/v1/completions", timeout=300,
            json={**body, "max_tokens": 256, "stream": True}, headers=AUTH,
        ) as stream:  # fmt: skip
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            # the signal reaches the gateway asynchronously: wait for it to stop being ready
            eventually(
                lambda: httpx.get(f"{base}/ready", timeout=60).status_code == 503,
                30, "/ready fails once draining",
            )  # fmt: skip
            refused = httpx.post(
                f"{base}/v1/completions", timeout=60, json={**body, "max_tokens": 2}, headers=AUTH
            )
            rest = [line for line in lines if line.startswith("data: ")]
        events = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
        tokens = sum(len(c["token_ids"]) for e in events for c in e.get("choices", []))
        assert tokens == 256 and rest[-1] == "data: [DONE]"  # drained, not cut
        assert refused.status_code == 503  # while draining
        t = time.monotonic()
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t < 10, "an idle cluster must exit within 10 s of draining"
    finally:
        _stop(proc, log)


def test_sigterm_while_starting_exits_within_10_s(tmp_path):
    port = free_port()
    proc, log = _serve(tmp_path, port)
    try:
        wait_until_ok(f"http://127.0.0.1:{port}/health", 240, proc)  # up, models still loading
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t < 10
    finally:
        _stop(proc, log)


def test_a_one_host_serve_binds_kv_servers_to_loopback():
    from services.config import load_config
    from services.launcher import for_one_host

    cfg = load_config(overrides={}, environ={})
    assert cfg.kv_host == "auto"  # the node's IP on a real cluster (the pod IP in Kubernetes)
    assert for_one_host(cfg).kv_host == "127.0.0.1"
    given = load_config(overrides={"kv_host": "10.1.2.3"}, environ={})
    assert for_one_host(given).kv_host == "10.1.2.3"


def test_a_local_ray_cluster_gets_a_fresh_token_unless_one_is_set():
    from services.launcher import local_ray_auth

    a: dict[str, str] = {}
    b: dict[str, str] = {}
    local_ray_auth(a)
    local_ray_auth(b)
    assert a["RAY_AUTH_MODE"] == "token" and len(a["RAY_AUTH_TOKEN"]) >= 32
    assert a["RAY_AUTH_TOKEN"] != b["RAY_AUTH_TOKEN"]
    given = {"RAY_AUTH_TOKEN": "mine"}
    local_ray_auth(given)
    assert given == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "mine"}
    off = {"RAY_AUTH_MODE": "disabled"}
    local_ray_auth(off)
    assert off == {"RAY_AUTH_MODE": "disabled"}  # the operator's choice stands
