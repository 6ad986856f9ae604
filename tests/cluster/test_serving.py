"""The cluster on a real local Ray (one per test session): gateway, prefill pool, decode pool,
KV over gRPC, through real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from services.config import load_config
from services.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PORT = 18431
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    from services.app import build_app

    ray.init(
        num_cpus=2,
        resources={"prefill_pool": 4, "decode_pool": 4},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    cfg = load_config(
        overrides={"prefill": {"num_kv_blocks": 256}, "decode": {"num_kv_blocks": 256}}, environ={}
    )
    serve.run(build_app(cfg), name="pdserve", route_prefix="/")
    yield serve
    serve.shutdown()
    ray.shutdown()


def _complete(body, stream=False):
    body = {"model": MODEL, **body, "stream": stream}
    if not stream:
        r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()
    ids = []
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                for ch in ev["choices"]:
                    ids.extend(ch["token_ids"])
    return ids, None


def test_disaggregated_tokens_equal_single_process(cluster, smollm_engine):
    prompt = smollm_engine.tokenizer.encode(
        "The three most important inventions of the last century are"
    )
    for params in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 42}):
        sp = SamplingParams(max_tokens=16, ignore_eos=True, **params)
        (want,) = smollm_engine.generate([prompt], sp)
        got, body = _complete({"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **params})
        assert got == want
        assert body["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 16,
            "total_tokens": len(prompt) + 16,
        }
        assert body["pdserve_timing"]["kv_transfer_s"] > 0
        streamed, _ = _complete(
            {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **params}, stream=True
        )
        assert streamed == want


def test_text_prompt_and_chat(cluster, smollm_engine):
    r = httpx.post(
        f"{BASE}/v1/chat/completions",
        timeout=300,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{BASE}/v1/models").json()["data"][0]["id"] == MODEL
    assert "pdserve_ttft_seconds_count" in httpx.get(f"{BASE}/metrics").text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ],
)
def test_bad_input_gets_status_and_body(cluster, body, status, param):
    r = httpx.post(f"{BASE}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    r = httpx.post(f"{BASE}/v1/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_failed_transfer_is_re_prefilled(cluster, smollm_engine):
    from ray import serve

    decode = serve.get_deployment_handle("decode", app_name="pdserve")
    decode.set_fail_next_pulls.remote(1).result()
    prompt = smollm_engine.tokenizer.encode("Once upon a time")
    (want,) = smollm_engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    got, _ = _complete({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert got == want
    assert "pdserve_kv_reprefills_total 1.0" in httpx.get(f"{BASE}/metrics").text
    decode.set_fail_next_pulls.remote(2).result()
    r = httpx.post(
        f"{BASE}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
        timeout=300,
    )
    assert r.status_code == 503
