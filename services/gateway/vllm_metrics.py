"""vLLM's metric names beside pdserve's own, so what reads a vLLM server (its published Grafana
dashboard, KEDA rules, llm-d's autoscaling) reads a pdserve cluster.

Every series has the ``model_name`` label (the served model id). Latencies and token counts
are the gateway's own observations of each request; ``num_requests_running`` / ``_waiting``
and ``kv_cache_usage_perc`` sum the engine replicas' latest reports (``record_routing_stats``,
polled by Ray Serve every ``routing_stats_period_s``), read at scrape time. The engine gauges
also carry a ``pool`` label (``prefill``, ``decode``): a request is running in the prefill
pool while its prompt computes and in the decode pool after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets for these histograms (its metrics module), so its dashboard's quantiles
# read the same resolution
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

Reports = Callable[[str], Sequence[dict[str, Any]]]  # pool -> its replicas' latest reports


class VllmMetrics:
    def __init__(
        self, registry: CollectorRegistry, model_name: str, pools: Sequence[str], reports: Reports
    ) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "time to first token (the gateway's)",
            labels, buckets=TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "inter-token latency (the gateway's)",
            labels, buckets=ITL_BUCKETS, registry=registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "end-to-end request latency (the gateway's)",
            labels, buckets=E2E_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "prompt tokens of prefilled requests", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "tokens generated", labels, registry=registry
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "prompt tokens looked up in a prefix cache",
            labels,
            registry=registry,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "prompt tokens served from a prefix cache",
            labels,
            registry=registry,
        )
        registry.register(_EngineGauges(model_name, pools, reports))

    def observe(
        self, ttft_s: float | None, itls: Sequence[float], e2e_s: float, output_tokens: int
    ) -> None:
        m = self.model_name
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        itl = self.itl.labels(m)
        for gap in itls:
            itl.observe(gap)
        self.e2e.labels(m).observe(e2e_s)
        self.generation_tokens.labels(m).inc(output_tokens)

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.prefix_queries.labels(m).inc(prompt_tokens)
        self.prefix_hits.labels(m).inc(cached_tokens)


class _EngineGauges(Collector):
    """Read at scrape time from the replicas' latest reports."""

    def __init__(self, model_name: str, pools: Sequence[str], reports: Reports) -> None:
        self.model_name = model_name
        self.pools = tuple(pools)
        self.reports = reports

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "pool"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "requests in the engines' running batches", labels=labels
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "requests waiting for an engine slot", labels=labels
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "share of the pool's KV blocks in use, 0-1 (cached, unreferenced blocks are free)",
            labels=labels,
        )
        for pool in self.pools:
            reps = [r for r in self.reports(pool) if "blocks_total" in r]
            if not reps:
                continue  # no replica has reported yet: no sample rather than a made-up 0
            key = [self.model_name, pool]
            running.add_metric(key, sum(int(r.get("running", 0)) for r in reps))
            waiting.add_metric(key, sum(int(r.get("waiting", 0)) for r in reps))
            total = sum(int(r["blocks_total"]) for r in reps)
            free = sum(int(r.get("blocks_free", 0)) for r in reps)
            usage.add_metric(key, (total - free) / total if total else 0.0)
        yield running
        yield waiting
        yield usage

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # NOTE: collected at scrape time only; nothing to check at register
