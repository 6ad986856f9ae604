"""vLLM's metric names on the gateway's /metrics, with model_name, and the queries of vLLM's
published Grafana dashboard (the panels' PromQL, checked here against a Prometheus text
parse: every series a query names exists with the model_name label)."""

from __future__ import annotations

import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.gateway import Metrics, Timing

# the series vLLM's dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# queries, as the issue lists them
DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval]) / rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval])',
]
REPORTS = {
    "prefill": [{"running": 1, "waiting": 2, "blocks_free": 60, "blocks_total": 100}],
    "decode": [
        {"running": 3, "waiting": 0, "blocks_free": 10, "blocks_total": 100},
        {"running": 4, "waiting": 1, "blocks_free": 30, "blocks_total": 100},
    ],
}


def _samples(metrics: Metrics) -> dict[str, list]:  # type: ignore[type-arg]
    text = generate_latest(metrics.registry).decode()
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _served(model: str = "smol") -> Metrics:
    m = Metrics(model, ["prefill", "decode"], lambda pool: REPORTS[pool])
    t = Timing(start=0.0, ttft_s=0.2, itls=[0.02, 0.03], last=0.25, num_output_tokens=3)
    m.observe(t)
    m.observe_prefix(100, 64)
    return m


def test_every_dashboard_query_finds_a_series_with_the_model_name():
    samples = _samples(_served())
    for query in DASHBOARD_QUERIES:
        for name in re.findall(r"(vllm:[a-z0-9_]+)\{", query):
            assert name in samples, f"{name} (from {query!r}) has no series"
            assert all(s.labels.get("model_name") == "smol" for s in samples[name]), name


def test_the_values_are_the_gateway_s_and_the_replicas():
    s = _samples(_served())

    def one(name, **labels):  # type: ignore[no-untyped-def]
        (v,) = [x.value for x in s[name] if all(x.labels.get(k) == w for k, w in labels.items())]
        return v

    assert one("vllm:prompt_tokens_total") == 100 and one("vllm:prefix_cache_hits_total") == 64
    assert one("vllm:prefix_cache_queries_total") == 100
    assert one("vllm:generation_tokens_total") == 3
    assert one("vllm:inter_token_latency_seconds_count") == 2
    assert one("vllm:time_to_first_token_seconds_count") == 1
    assert one("vllm:num_requests_running", pool="decode") == 7
    assert one("vllm:num_requests_waiting", pool="prefill") == 2
    assert one("vllm:kv_cache_usage_perc", pool="decode") == 0.8  # 160 of 200 blocks used
    assert one("vllm:kv_cache_usage_perc", pool="prefill") == 0.4


def test_no_engine_gauge_before_a_replica_reports():
    m = Metrics("smol", ["decode"], lambda pool: [])
    s = _samples(m)
    assert "vllm:kv_cache_usage_perc" not in s and "vllm:num_requests_running" not in s


def test_the_chart_dashboard_s_vllm_queries_find_series():
    import json
    from pathlib import Path

    dash = Path(__file__).resolve().parents[1] / "helm/pdserve/dashboards/pdserve.json"
    exprs = [t["expr"] for p in json.loads(dash.read_text())["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"(vllm:[a-z0-9_]+)", e)}
    assert len(names) >= 6
    samples = _samples(_served())
    assert not names - set(samples), f"no series for {sorted(names - set(samples))}"
