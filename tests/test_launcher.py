"""`pdserve serve` as a user runs it: starts its own local Ray cluster, serves, stops on SIGTERM.
(Runs after the cluster tests' Ray has shut down; it ends only the process it started.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.fixtures import free_port, wait_until_ok

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_serve_starts_answers_and_stops_on_sigterm(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - outlives the Popen call below
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
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 240
        wait_until_ok(f"http://127.0.0.1:{port}/health", 240, proc)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=300,
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Hello",
                "max_tokens": 4,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the endpoints are printed once serve.run has returned
        while f"http://127.0.0.1:{port}/v1" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline, "pdserve serve did not print its endpoints"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:  # failed test: still stop it cleanly so it stops its Ray
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        log.close()
