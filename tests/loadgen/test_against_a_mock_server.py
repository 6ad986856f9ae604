"""``pdserve bench`` against an OpenAI-compatible server that is not pdserve (guidellm's mock
vLLM server, with set latencies): it measures what the server was told to do, without
pdserve's extensions (no ``token_ids``, no ``pdserve_timing``), and counts failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.cli import main
from tests.fixtures import eventually

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mock_server(tmp_path):
    """Start a mock server (TTFT 150 ms, ITL 20 ms, 10 tokens; 500 after 14 requests)."""
    port = _free_port()
    cmd = [
        str(Path(sys.executable).with_name("guidellm")), "mock-server", "--host", "127.0.0.1",
        "--port", str(port), "--model", "mock", "--ttft-ms", "150", "--itl-ms", "20",
        "--output-tokens", "10", "--fail-after-requests", "14",
    ]  # fmt: skip
    # NOTE: no --processor: guidellm 0.8.1's mock loads one with transformers' slow-tokenizer
    # class, which transformers 5 cannot build from a tokenizer.json; it counts with its own
    # word tokenizer instead
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "mock.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None  # died: stop waiting, the assert below says so

    try:
        eventually(up, 60, "the mock server")
        assert proc.poll() is None, (tmp_path / "mock.log").read_text()[-2000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_bench_measures_a_mock_server_s_latencies_and_its_failures(mock_server, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--url", mock_server, "--model", "mock", "--no-ignore-eos", "--no-progress",
            "--requests", "8", "--input-len", "fixed:32", "--output-len", "fixed:10",
            "--concurrency", "2", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    (run,) = json.loads(out.read_text())["runs"]
    s = run["summary"]
    assert (s["completed"], s["errors"]) == (8, 0)
    # the mock's set latencies are floors (its sleeps); a loaded host only adds to them
    assert 0.12 <= s["ttft_s"]["p50"] <= 0.6
    assert 0.015 <= s["itl_s"]["p50"] <= 0.1
    assert s["output_tokens"]["p50"] == 10 and s["input_tokens"]["p50"] > 0
    assert all(r["server"] is None for r in run["records"])  # not pdserve: no server timing
    # the server fails every request after its 14th: of the next 8, 6 succeed and 2 fail
    assert main([*args, "--rate", "50", "--concurrency", ""]) == 1  # failures: exit 1
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["summary"]["completed"], run["summary"]["errors"]) == (6, 2)
    failed = [r for r in run["records"] if r["error"] is not None]
    assert all(r["error"].startswith("HTTP 500") for r in failed)
