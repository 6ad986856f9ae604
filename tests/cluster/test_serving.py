"""The cluster on a real local Ray (tests/cluster/conftest.py): gateway, prefill pool, decode
pool, KV over gRPC, through real HTTP. Three apps share the cluster: disaggregated (2 prefill +
2 decode replicas), colocated, and conditional disaggregation."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest

from services.engine.sampling_params import SamplingParams
from tests.cluster.conftest import BASE, MODEL, complete, deploy, replica_stats, undeploy
from tests.fixtures import eventually

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPS = {"pdserve": "", "colo": "/colo", "cond": "/cond"}


@pytest.fixture(scope="module")
def cluster(ray_serve):
    pools = {"num_kv_blocks": 256}
    deploy(
        {
            "pdserve": (
                "",
                {"prefill": {**pools, "replicas": 2}, "decode": {**pools, "replicas": 2}},
            ),
            "colo": ("/colo", {"mode": "colocated", "decode": pools}),
            "cond": ("/cond", {"conditional_threshold": 12, "prefill": pools, "decode": pools}),
        }
    )
    yield ray_serve
    undeploy(APPS)


@pytest.mark.parametrize("app", list(APPS))
def test_every_mode_gives_single_process_tokens(cluster, smollm_engine, app):
    prompt = smollm_engine.tokenizer.encode(
        "The three most important inventions of the last century are"
    )
    for params in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 42}):
        sp = SamplingParams(max_tokens=12, ignore_eos=True, **params)
        (want,) = smollm_engine.generate([prompt], sp)
        body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, **params}
        got, resp = complete(body, prefix=APPS[app])
        assert got == want
        assert resp["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 12,
            "total_tokens": len(prompt) + 12,
            "prompt_tokens_details": {"cached_tokens": resp["pdserve_timing"]["num_cached_tokens"]},
        }
        assert (resp["pdserve_timing"]["kv_transfer_s"] > 0) == (
            app == "pdserve"
        )  # cond: prompt is long
        assert complete(body, stream=True, prefix=APPS[app])[0] == want


def test_conditional_short_prompt_skips_the_prefill_pool(cluster, smollm_engine):
    prompt = smollm_engine.tokenizer.encode("Hi there")  # under the threshold of 12
    (want,) = smollm_engine.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    got, resp = complete(
        {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}, prefix="/cond"
    )
    assert got == want and resp["pdserve_timing"]["kv_transfer_s"] == 0


def test_conditional_disaggregation_counts_only_the_uncached_length(cluster, smollm_engine):
    # A 48-token prompt goes through the prefill pool; the decode replica keeps its 3 blocks
    # cached (in-process index of the app). The follow-up adds 3 tokens: 51 tokens, but only
    # 3 uncached on the decode replica, under the threshold of 12: prefilled there, no transfer.
    from ray import serve

    tok = smollm_engine.tokenizer
    first = tok.encode(
        "In the quiet harbour town of Millbrook the baker opened his shop before dawn, and the "
        "fishermen queued in the dark for warm bread, talking about the weather and the tides "
        "and the price of diesel, while gulls waited on the roofs."
    )[:48]
    follow = [*first, *tok.encode(" Then what?")[:3]]
    assert len(first) == 48 and len(follow) == 51
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    _, resp = complete({"prompt": first, **body}, prefix="/cond")
    assert resp["pdserve_timing"]["kv_transfer_s"] > 0
    decode = serve.get_deployment_handle("decode", app_name="cond")
    assert decode.flush_index.remote().result()
    got, resp = complete({"prompt": follow, **body}, prefix="/cond")
    assert resp["pdserve_timing"]["kv_transfer_s"] == 0
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    smollm_engine.blocks.reset_prefix_cache()
    assert got == smollm_engine.generate([follow], SamplingParams(**body))[0]


def test_32_concurrent_streams_on_two_pools(cluster, smollm_engine):
    rng = random.Random(7)
    reqs = [
        ([rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))], rng.randrange(2, 9))
        for _ in range(32)
    ]
    want = [
        smollm_engine.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        for p, n in reqs
    ]

    async def one(client, prompt, n):
        ids = []
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{BASE}/v1/completions", json=body, timeout=600) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        ids.extend(ch["token_ids"])
        return ids

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in reqs))

    assert asyncio.run(main()) == want
    decode = replica_stats("pdserve", "decode", 2)
    assert all(i.stats.num_steps > 0 for i in decode.values()), "a decode replica got no work"
    for dep in ("prefill", "decode"):
        for info in replica_stats("pdserve", dep, 2).values():
            s = info.stats
            assert s.blocks_used == 0 and s.num_running == 0 and s.num_held == 0
            # placement, from Ray's own data: each replica holds its own pool's resource only
            assert info.resources.get(f"{dep}_pool") == 1, info.resources
            other = "decode" if dep == "prefill" else "prefill"
            assert f"{other}_pool" not in info.resources


def test_client_disconnect_frees_blocks(cluster):
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{BASE}/colo/v1/completions", json=body, timeout=300) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break
    eventually(lambda: _idle(replica_stats("colo", "decode", 1)), 60, "the decode replica idle")


def _idle(stats: dict) -> bool:
    (info,) = stats.values()
    return info.stats.blocks_used == 0 and info.stats.num_running == 0


def test_openai_client_streams_chat(cluster):
    import openai

    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")

    def ask(**extra):  # type: ignore[no-untyped-def]
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            **extra,
        )

    # NOTE: every event carries a choice unless the client asked for the usage event
    text = "".join(c.choices[0].delta.content or "" for c in ask())
    assert "Paris" in text
    events = list(ask(stream_options={"include_usage": True}))
    assert all(e.choices and e.usage is None for e in events[:-1])
    streamed = sum(len(e.choices[0].model_extra["token_ids"]) for e in events[:-1])
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == streamed > 0
    # vLLM's continuous_usage_stats: every event also carries the usage so far
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = list(ask(stream_options=opts))
    counts = [e.usage.completion_tokens for e in events]
    assert counts == sorted(counts) and counts[-1] == streamed and counts[0] >= 1
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{BASE}/version", timeout=30).json() == {"version": "0.1.0"}
    assert "pdserve_ttft_seconds_count" in httpx.get(f"{BASE}/metrics").text
    # vLLM's names, with the model's name; the engine gauges from the replicas' reports
    # (Ray Serve polls them every routing_stats_period_s: wait for the first)
    label = f'model_name="{MODEL}"'

    def vllm_series() -> str | None:
        text = httpx.get(f"{BASE}/metrics", timeout=30).text
        want = ("vllm:kv_cache_usage_perc{", "vllm:num_requests_running{")
        return text if all(w + label in text for w in want) else None

    text = eventually(vllm_series, 60, "the vLLM engine gauges", every_s=0.5)
    assert f"vllm:generation_tokens_total{{{label}}}" in text
    assert f"vllm:time_to_first_token_seconds_count{{{label}}}" in text
    usage = re.search(r'vllm:kv_cache_usage_perc\{[^}]*pool="decode"[^}]*\} (\S+)', text)
    assert usage is not None and 0.0 <= float(usage.group(1)) <= 1.0


def test_openai_client_reads_logprobs_streamed_and_not(cluster):
    """OpenAI's shapes through the P/D flow: the first token's alternatives come from the
    prefill replica, the rest from the decode replica."""
    import openai

    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    r = client.chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen token is the top one
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4
    assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content
    streamed = [
        x
        for ev in client.chat.completions.create(**ask, stream=True)
        if ev.choices and ev.choices[0].logprobs
        for x in ev.choices[0].logprobs.content
    ]
    # NOTE: the same tokens; log-probabilities within 0.01 (the second request hits the
    # prefix cache, and by step size its prompt's tail may round differently)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 0.01 for a, b in zip(streamed, content, strict=True))
    c = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0


@pytest.mark.parametrize("app", ["pdserve", "colo"])
def test_echo_scores_the_prompt_as_the_engine_does(cluster, smollm_engine, app):
    """Completions ``echo`` with ``logprobs`` (what evaluation harnesses send): the prompt
    leads the text and the logprobs, its scores equal the single-process engine's, streamed
    and not, across the P/D handoff and colocated alike."""
    import openai

    client = openai.OpenAI(base_url=f"{BASE}{APPS[app]}/v1", api_key="unused")
    text = "The capital of France is Paris, and the capital of Italy is"
    ids = smollm_engine.tokenizer.encode(text)
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    smollm_engine.add_request("echo-ref", ids, sp)
    outs = []
    while smollm_engine.has_unfinished:
        outs += smollm_engine.step()
    (want,) = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    ask = dict(model=MODEL, prompt=text, max_tokens=2, temperature=0, logprobs=2, echo=True)
    r = client.completions.create(**ask)
    c = r.choices[0]
    assert c.text.startswith(text) and len(c.text) > len(text)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(a) == 2 for a in lp.top_logprobs[1:])
    got = lp.token_logprobs[1 : len(ids)]
    assert got == pytest.approx([w for w, _ in want], abs=1e-3)
    assert "".join(lp.tokens) == c.text and lp.text_offset[len(ids)] == len(text)
    streamed = list(client.completions.create(**ask, stream=True))
    assert "".join(e.choices[0].text for e in streamed) == c.text
    first = streamed[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1 : len(ids)] == pytest.approx(got, abs=1e-3)
    plain = client.completions.create(**{**ask, "echo": False})
    assert c.text == text + plain.choices[0].text  # echo changes nothing else


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_against_the_cluster(cluster, tmp_path, route):
    """An OpenAI-compatible load generator from PyPI, as a user would point it at pdserve:
    every request succeeds (it streams with vLLM's continuous usage stats and ignore_eos) and
    its token counts are the ones it asked for."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from services.engine.loader import default_model_path, gguf_cache_folder

    out = tmp_path / "benchmarks.json"
    spec = {
        "backend": {"kind": "openai_http", "target": BASE, "model": MODEL, "request_format": route},
        "profile": {"kind": "concurrent", "streams": 2},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": 12}],
        # NOTE: the model's own tokenizer, from the converted GGUF: nothing is downloaded
        "tokenizer": {"kind": "hf_auto", "model": str(gguf_cache_folder(default_model_path()))},
        "constraints": [{"kind": "max_requests", "count": 6}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"spec": spec}))
    guidellm = Path(sys.executable).with_name("guidellm")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(
        [str(guidellm), "run", "--scenario", str(scenario), "--disable-console-interactive"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (6, 0, 0), [
        r["info"]["error"] for r in bench["requests"]["errored"]
    ]
    for r in bench["requests"]["successful"]:
        assert r["output_metrics"]["text_tokens"] == 12
        assert r["input_metrics"]["text_tokens"] >= 64


def test_pdserve_bench_figures_agree_with_the_cluster_s_own(cluster, tmp_path):
    """``pdserve bench`` against the cluster, open loop and closed loop (multi-turn chat): every
    request succeeds, each TTFT it measures is the gateway's own (``pdserve_timing``) plus the
    way to the client, the token counts are the asked ones, and the report and plots land."""
    from services.cli import main

    report = tmp_path / "bench.json"
    common = ["bench", "--url", BASE, "--model", MODEL, "--json", str(report), "--no-progress"]
    assert main([*common, "--requests", "6", "--input-len", "uniform:40:80", "--output-len",
                 "fixed:8", "--rate", "2,4", "--plots", str(tmp_path / "plots")]) == 0  # fmt: skip
    runs = json.loads(report.read_text())["runs"]
    assert [r["rate"] for r in runs] == [2.0, 4.0]
    for run in runs:
        s = run["summary"]
        assert (s["completed"], s["errors"]) == (6, 0)
        assert 40 <= s["input_tokens"]["p50"] <= 90 and s["output_tokens"]["p50"] == 8
        for r in run["records"]:
            gap = r["ttft_s"] - r["server"]["ttft_s"]
            assert -0.005 <= gap < 1.0, r  # the client sees the first token after the gateway
            assert r["e2e_s"] >= r["server"]["e2e_s"] - 0.005
            assert len(r["itls"]) == 7
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"latency_cdf.png", "rate_sweep.png"}
    assert main([*common, "--workload", "multiturn", "--chat", "--requests", "4", "--turns", "2",
                 "--system-len", "64", "--input-len", "fixed:16", "--output-len", "fixed:6",
                 "--concurrency", "2"]) == 0  # fmt: skip
    (run,) = json.loads(report.read_text())["runs"]
    recs = run["records"]
    assert run["summary"]["completed"] == 4 and [r["turn"] for r in recs] == [0, 1, 0, 1]
    # a second turn re-sends the first and its answer: longer, and mostly from the prefix cache
    assert recs[1]["prompt_tokens"] > recs[0]["prompt_tokens"] + 16
    assert recs[1]["server"]["num_cached_tokens"] > 0


def test_the_doctor_endpoint_describes_both_pools(cluster):
    """``/pdserve/doctor``: each replica of each pool with its profile, counters and step costs
    (from the replicas' routing reports: wait for reports that carry steps)."""
    complete({"prompt": "The sky is", "max_tokens": 4})

    def evidence() -> dict | None:
        ev = httpx.get(f"{BASE}/pdserve/doctor", timeout=30).json()
        pools = ev["pools"]
        counted = all(
            len(pools[p]) == 2 and any(r["stats"]["num_steps"] for r in pools[p])
            for p in ("prefill", "decode")
        )
        return ev if counted else None

    ev = eventually(evidence, 60, "reports of both pools with steps", every_s=0.5)
    assert (ev["model"], ev["mode"]) == (MODEL, "disaggregated")
    for pool in ("prefill", "decode"):
        for r in ev["pools"][pool]:
            assert r["profile"]["pool"] == pool and r["profile"]["weight_bytes"] > 0
            assert r["profile"]["num_kv_blocks"] == 256
    steps = [b for r in ev["pools"]["prefill"] for b in r["steps"]]
    assert steps and all(b["with_prompt"] for b in steps)  # prefill replicas only prefill
    assert any(b["rows"] > 0 for r in ev["pools"]["decode"] for b in r["steps"])


def test_pdserve_doctor_on_the_live_cluster(cluster, tmp_path, capsys):
    """The doctor's probe load and the cluster's own account: six answers, none unknown."""
    from services.cli import main

    out = tmp_path / "doctor.json"
    args = ["doctor", "--url", BASE, "--model", MODEL, "--probe-requests", "8",
            "--probe-concurrency", "2", "--probe-input-len", "fixed:64",
            "--probe-output-len", "fixed:8", "--json", str(out),
            "--html", str(tmp_path / "doctor.html")]  # fmt: skip
    assert main(args) == 0
    assert (tmp_path / "doctor.html").read_text().count("<section") == 6
    answers = json.loads(out.read_text())["answers"]
    assert [a["number"] for a in answers] == [1, 2, 3, 4, 5, 6]
    assert all(a["verdict"] in ("fine", "look here") for a in answers), answers
    assert answers[2]["figures"]["decode_step_ms_by_batch"]  # the decode pool's step costs
    assert answers[4]["figures"]["floor_ms_now"] > 0
    assert "pdserve doctor: live cluster" in capsys.readouterr().out


def test_n_choices_and_batched_prompts(cluster):
    import openai

    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Say a word."}]
    ask = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=1.0, seed=11, n=3)
    r = client.chat.completions.create(**ask)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # each choice its own sample (seed + i)
    again = client.chat.completions.create(**ask)
    assert [c.message.content for c in again.choices] == texts  # and reproducible
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    streamed: dict[int, str] = {}
    for ev in client.chat.completions.create(**ask, stream=True):
        for c in ev.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts
    # greedy, a batch of two prompts with n=2: prompt p's choice i is choice 2p + i
    c = client.completions.create(
        model=MODEL, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0, n=2
    )
    by_index = {x.index: x.text for x in c.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] != by_index[2] == by_index[3]
    one = client.completions.create(model=MODEL, prompt="Water is", max_tokens=4, temperature=0)
    assert one.choices[0].text == by_index[2]
    prompt_tokens = len(
        httpx.post(f"{BASE}/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    )
    prompt_tokens += len(
        httpx.post(f"{BASE}/tokenize", json={"prompt": "Water is"}).json()["tokens"]
    )
    assert c.usage.prompt_tokens == prompt_tokens  # each prompt once, whatever n


@pytest.mark.parametrize("app", ["pdserve", "colo"])
def test_openai_client_gets_schema_valid_json(cluster, app):
    """``response_format`` through the official client, streamed and not: the output parses
    and validates against the schema, across the P/D handoff and colocated alike."""
    import jsonschema
    import openai

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=f"{BASE}{APPS[app]}/v1", api_key="unused")
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "The largest city in France, as JSON."}],
        max_tokens=64,
        temperature=0.7,
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    r = client.chat.completions.create(**ask)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed = "".join(
        ev.choices[0].delta.content or ""
        for ev in client.chat.completions.create(**ask, stream=True)
        if ev.choices
    )
    assert streamed == r.choices[0].message.content  # seeded: the same sample
    obj = client.completions.create(
        model=MODEL,
        prompt="A JSON object about a cat:",
        max_tokens=120,
        temperature=0,
        frequency_penalty=0.5,
        # NOTE: OpenAI's completions endpoint has no response_format; vLLM's does
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].text), dict)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (
            {
                "prompt": "hi",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                },
            },
            400,
            "response_format.json_schema.schema",
        ),
        ({"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ({"prompt": [1, 999999]}, 400, "prompt"),
        ({"prompt": "hi", "top_p": 3}, 400, "top_p"),
        ({"prompt": "hi", "stop": 5}, 400, "stop"),
        ({"prompt": "hi", "temperature": 1e-38}, 400, "temperature"),
        ({"prompt": "hi", "stop": ["x"] * 40_000}, 400, "stop"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options.x"),
    ],
)
def test_bad_input_gets_status_and_body_while_others_stream(cluster, body, status, param):
    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            good = c.post(
                f"{BASE}/v1/completions",
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
            )
            bad = c.post(f"{BASE}/v1/completions", json={"model": MODEL, **body})
            return await asyncio.gather(good, bad)

    good, bad = asyncio.run(main())
    assert bad.status_code == status, bad.text
    assert bad.json()["error"]["param"] == param
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    r = httpx.post(f"{BASE}/v1/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b'{"model": "M", "prompt": "a\\ud800"}', 400, "prompt"),  # a lone surrogate
        (b'{"model": "M", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
        (b'{"model": "M", "prompt": "hi", "top_p": Infinity}', 400, "top_p"),
        (b"[" * 5000 + b"]" * 5000, 400, "body"),  # 5,000 levels deep
        (b'{"model": "M", "prompt": "' + b"a" * (4 << 20) + b'"}', 413, "body"),  # 4 MB
    ],
)
def test_malformed_bodies_get_4xx_naming_the_field(cluster, content, status, param):
    content = content.replace(b'"M"', f'"{MODEL}"'.encode())
    t = time.perf_counter()
    r = httpx.post(f"{BASE}/v1/completions", content=content, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if status == 413:
        assert time.perf_counter() - t < 2  # refused before tokenizing 4 MB (was 6.8 s)


def test_a_decode_replica_killed_mid_stream_is_resumed_exactly(cluster, smollm_engine):
    """Mid-stream failover: the decode replica streaming a request is killed (SIGKILL-like,
    no goodbye) after some tokens; the gateway resumes the request on the other decode
    replica (same seed, replay checked and stripped): the client gets every token once, the
    same tokens as an unfaulted run, and a normal end. Regression: the stream used to end
    normally after the tokens sent so far."""
    import ray

    prompt = smollm_engine.tokenizer.encode("Write a long story about a lighthouse keeper.")
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0.9}
    body["seed"] = 11
    want, _ = complete(body)  # unfaulted, same seed
    ids: list[int] = []
    ends: list[str] = []
    with httpx.stream(
        "POST", f"{BASE}/v1/completions", json={"model": MODEL, **body, "stream": True},
        timeout=300,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        killed = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                ends.append("done")
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            for ch in event["choices"]:
                ids.extend(ch["token_ids"])
            if not killed and len(ids) >= 10:
                busy = [
                    i for i in replica_stats("pdserve", "decode", 2).values()
                    if i.stats.num_running > 0  # type: ignore[attr-defined]
                ]  # fmt: skip
                (uid,) = [i.index_id.split("-", 1)[1] for i in busy]  # type: ignore[attr-defined]
                (name,) = [
                    a["name"]
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA") and a["name"].endswith(uid)
                ]
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                killed = True
    assert killed and ends == ["done"]
    assert ids == want  # every token exactly once, the unfaulted run's tokens
    metrics = httpx.get(f"{BASE}/metrics", timeout=30).text
    assert "pdserve_resumes_total" in metrics and "pdserve_resumes_total 0.0" not in metrics


def test_failed_transfer_is_re_prefilled_then_503(cluster, smollm_engine):
    from ray import serve

    decode = serve.get_deployment_handle("decode", app_name="cond")
    prompt = smollm_engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    (want,) = smollm_engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    decode.set_fail_next_pulls.remote(1).result()
    got, _ = complete(
        {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, prefix="/cond"
    )
    assert got == want
    assert "pdserve_kv_reprefills_total 1.0" in httpx.get(f"{BASE}/cond/metrics").text
    decode.set_fail_next_pulls.remote(2).result()
    r = httpx.post(
        f"{BASE}/cond/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
        timeout=300,
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and "KV transfer failed" in message
    assert "Traceback" not in message and ".py" not in message  # no replica internals
    for info in replica_stats("cond", "prefill", 1).values():
        assert info.stats.blocks_used == 0 and info.stats.num_held == 0
