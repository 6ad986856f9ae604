"""Serving benchmark: disaggregated vs colocated on the same workload, in one run.

Starts a local Ray cluster, deploys both apps side by side with the same number of replicas
(disaggregated: P prefill + D decode; colocated: P + D replicas doing both), then replays one
Poisson arrival schedule of mixed prompt/output lengths against each, streaming over HTTP.
Reports TTFT, ITL and end-to-end p50/p90/p99, throughput and goodput (requests/s meeting both
the TTFT and the ITL SLO), measured at the client.

    OMP_NUM_THREADS=1 .venv/bin/python bench/serving_bench.py [--requests 40] [--rate 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx

MODEL = "SmolLM2-135M-Instruct"


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> dict[str, object]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},  # the usage event the bench reads
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, object] = {}
    async with client.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage  # on the last event
                for ch in ev.get("choices", []):
                    stamps.extend([time.perf_counter()] * len(ch["token_ids"]))
    end = time.perf_counter()
    itls = [b - a for a, b in itertools.pairwise(stamps) if b > a] or [0.0]
    return {
        "ttft": stamps[0] - t0,
        "itl": statistics.mean(itls),
        "itls": itls,
        "e2e": end - t0,
        "tokens": len(stamps),
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),  # type: ignore[union-attr]
    }


async def replay(
    url: str, schedule: list[tuple[float, list[int], int]]
) -> tuple[list[dict[str, object]], float]:
    async with httpx.AsyncClient() as client:
        start = time.perf_counter()

        async def at(t: float, p: list[int], n: int) -> dict[str, object]:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await one(client, url, p, n)

        results = await asyncio.gather(*(at(t, p, n) for t, p, n in schedule))
        return list(results), time.perf_counter() - start


def start_cluster(resources: dict[str, float], port: int) -> None:
    """A local Ray cluster with the pools' resources, and Serve's HTTP proxy on ``port``."""
    import ray
    from ray import serve

    ray.init(
        resources=resources,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})


def finish(rows: dict[str, dict[str, float]], json_path: str | None) -> None:
    """Write the rows (``--json``) and stop the cluster ``start_cluster`` started."""
    import ray
    from ray import serve

    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    serve.shutdown()
    ray.shutdown()


def report(
    name: str, results: list[dict[str, object]], wall: float, slo_ttft: float, slo_itl: float
) -> dict[str, float]:
    ttft = [float(r["ttft"]) for r in results]
    itl = [g for r in results for g in r["itls"]]  # type: ignore[attr-defined]
    e2e = [float(r["e2e"]) for r in results]
    good = sum(1 for r in results if float(r["ttft"]) <= slo_ttft and float(r["itl"]) <= slo_itl)
    tokens = sum(int(r["tokens"]) for r in results)
    row = {
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p90": pct(itl, 90),
        "itl_p99": pct(itl, 99),
        "e2e_p50": pct(e2e, 50),
        "e2e_p90": pct(e2e, 90),
        "e2e_p99": pct(e2e, 99),
        "req_per_s": len(results) / wall,
        "tok_per_s": tokens / wall,
        "goodput": good / wall,
        "slo_attained": good / len(results),
    }
    print(
        f"{name:>14}: TTFT p50/p90/p99 {row['ttft_p50'] * 1e3:6.0f}/{row['ttft_p90'] * 1e3:6.0f}/{row['ttft_p99'] * 1e3:6.0f} ms  "
        f"ITL {row['itl_p50'] * 1e3:5.0f}/{row['itl_p90'] * 1e3:5.0f}/{row['itl_p99'] * 1e3:5.0f} ms  "
        f"e2e {row['e2e_p50']:5.1f}/{row['e2e_p90']:5.1f}/{row['e2e_p99']:5.1f} s  "
        f"{row['req_per_s']:.2f} req/s  {row['tok_per_s']:.1f} tok/s  goodput {row['goodput']:.2f} req/s "
        f"({row['slo_attained']:.0%} in SLO)",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrival rate, requests/s")
    ap.add_argument("--prefill-replicas", type=int, default=1)
    ap.add_argument("--decode-replicas", type=int, default=1)
    ap.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    ap.add_argument("--slo-itl", type=float, default=0.25, help="seconds (mean per request)")
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from ray import serve

    from services.app import build_app
    from services.config import load_config

    p, d = args.prefill_replicas, args.decode_replicas
    start_cluster({"prefill_pool": p, "decode_pool": d + p + d}, args.port)
    pools = {"num_kv_blocks": 2048}
    serve.run(
        build_app(
            load_config(
                overrides={"prefill": {**pools, "replicas": p}, "decode": {**pools, "replicas": d}},
                environ={},
            )
        ),
        name="disagg",
        route_prefix="/",
    )
    serve.run(
        build_app(
            load_config(
                overrides={"mode": "colocated", "decode": {**pools, "replicas": p + d}}, environ={}
            )
        ),
        name="colo",
        route_prefix="/colo",
    )
    base = f"http://127.0.0.1:{args.port}"

    rng = random.Random(0)
    t = 0.0
    schedule = []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(100, 40000) for _ in range(rng.choice([32, 128, 256, 512]))]
        schedule.append((t, prompt, rng.choice([16, 32, 64])))
    for url in (f"{base}/v1/completions", f"{base}/colo/v1/completions"):  # warm-up
        asyncio.run(replay(url, [(0.0, [5] * 16, 2)]))
    print(
        f"{args.requests} requests, Poisson {args.rate}/s, prompts 32-512 tokens, outputs 16-64; "
        f"{p} prefill + {d} decode vs {p + d} colocated replicas; SLO TTFT {args.slo_ttft}s, ITL {args.slo_itl}s"
    )
    rows = {}
    for name, url in (
        ("disaggregated", f"{base}/v1/completions"),
        ("colocated", f"{base}/colo/v1/completions"),
    ):
        results, wall = asyncio.run(replay(url, schedule))
        rows[name] = report(name, results, wall, args.slo_ttft, args.slo_itl)
    a, b = rows["disaggregated"], rows["colocated"]
    print(
        f"disaggregated / colocated: ITL p90 {a['itl_p90'] / b['itl_p90']:.2f}x, TTFT p90 {a['ttft_p90'] / b['ttft_p90']:.2f}x, "
        f"goodput {a['goodput'] / max(b['goodput'], 1e-9):.2f}x"
    )
    finish(rows, args.json)


if __name__ == "__main__":
    main()
