"""``pdserve doctor`` on live clusters built to be bad in one way each, and on a healthy one:
it names the cause (tests/cluster/conftest.py starts the Ray cluster; each app here has its
own route prefix)."""

from __future__ import annotations

import json

import pytest

from services.cli import main
from tests.cluster.conftest import BASE, MODEL, deploy, undeploy

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPS = {
    # the decode pool holds 256 tokens of KV: two requests of the probe's lengths
    "kvsmall": ("/kvsmall", {"prefill": {"num_kv_blocks": 256}, "decode": {"num_kv_blocks": 16}}),
    # one decode replica for many long decodes
    "onedecode": ("/onedecode", {"prefill": {"num_kv_blocks": 256}, "decode": {"num_kv_blocks": 512}}),
    # colocated with a budget that takes a whole long prompt into a step beside the decodes
    "chunky": ("/chunky", {"mode": "colocated",
                           "decode": {"num_kv_blocks": 512, "max_num_batched_tokens": 2048}}),
}  # fmt: skip


@pytest.fixture(scope="module")
def clusters(ray_serve):
    deploy(APPS)
    yield
    undeploy(APPS)


def _doctor(tmp_path, app: str, *args: str) -> list[dict]:
    out = tmp_path / f"{app}.json"
    argv = ["doctor", "--url", BASE + APPS[app][0], "--model", MODEL, "--json", str(out), *args]
    assert main(argv) == 0
    return json.loads(out.read_text())["answers"]


def test_a_kv_pool_too_small_for_the_load(clusters, tmp_path):
    answers = _doctor(tmp_path, "kvsmall", "--probe-requests", "12", "--probe-concurrency", "6",
                      "--probe-input-len", "fixed:96", "--probe-output-len", "fixed:32")  # fmt: skip
    kv = answers[3]
    assert kv["verdict"] == "look here" and "KV" in kv["cause"], kv
    assert kv["figures"]["requests_that_fit"] < 6 and "kv_cache_dtype" in kv["action"]


def test_one_decode_replica_under_heavy_decode_load(clusters, tmp_path):
    answers = _doctor(tmp_path, "onedecode", "--probe-requests", "16", "--probe-concurrency",
                      "16", "--probe-input-len", "fixed:16", "--probe-output-len", "fixed:48",
                      "--slo-tpot", "0.02", "--slo-ttft", "30")  # fmt: skip
    itl = answers[2]
    assert itl["verdict"] == "look here" and "add a decode replica" in itl["action"], itl


def test_a_chunk_budget_that_lets_long_prefills_stall_decodes(clusters, tmp_path):
    answers = _doctor(tmp_path, "chunky", "--probe-requests", "9", "--probe-concurrency", "3",
                      "--probe-input-len", "fixed:400", "--probe-output-len", "fixed:6",
                      "--slo-tpot", "0.03", "--slo-ttft", "60")  # fmt: skip
    itl = answers[2]
    assert itl["verdict"] == "look here" and "stall" in itl["cause"], itl
    assert "max_num_batched_tokens" in itl["action"]


def test_a_healthy_cluster_gets_a_clean_bill(clusters, tmp_path):
    """The roomy app under a gentle load and SLOs it can meet: nothing to look at. (Prompts of
    256 tokens: shorter ones in a disaggregated cluster without a conditional threshold are a
    finding of question 1.)"""
    answers = _doctor(tmp_path, "onedecode", "--probe-requests", "6", "--probe-concurrency", "1",
                      "--probe-input-len", "fixed:256", "--probe-output-len", "fixed:8",
                      "--slo-ttft", "10", "--slo-tpot", "1")  # fmt: skip
    assert [a["verdict"] for a in answers] == ["fine"] * 6, answers
