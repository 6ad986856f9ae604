"""Prefix benchmark: prefix-aware against least-loaded routing on a shared-prefix workload.

Workload: ``--prompts`` distinct system prompts of ``--system-tokens`` tokens (8 x 1,000 by
default), each followed by a short user turn; ``--rounds`` rounds, each sending one turn for
every system prompt in a shuffled order (tenants interleaved, as a shared cluster sees them),
``--concurrency`` requests in flight, streamed over HTTP. Both policies are deployed side by
side in one local Ray cluster (``--prefill-replicas`` prefill + 1 decode replica each) and fed
the same requests; prefill replicas have ``--kv-blocks`` blocks each, enough for about half of
the system prompts: partitioning them (prefix-aware) fits, spreading them (least-loaded) does
not.

Reports per policy: prefix hit rate (tokens and requests, from each response's
``usage.prompt_tokens_details.cached_tokens``), the ideal hit rate (every system prompt
computed once in the cluster, every later turn reusing all of its full blocks), prefill
tokens computed (the prefill replicas' engine counters) and TTFT p50/p99 at the client.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_bench.py [--rounds 6] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
from serving_bench import finish, one, pct, start_cluster

BLOCK = 16


async def closed_loop(
    url: str, reqs: list[tuple[list[int], int]], concurrency: int
) -> list[dict[str, object]]:
    out: list[dict[str, object]] = [{} for _ in reqs]
    queue = list(enumerate(reqs))
    async with httpx.AsyncClient() as client:

        async def worker() -> None:
            while queue:
                i, (prompt, n) = queue.pop(0)
                out[i] = await one(client, url, prompt, n)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def prefill_computed(app: str, n: int) -> int:
    from ray import serve

    handle = serve.get_deployment_handle("prefill", app_name=app)
    seen: dict[str, int] = {}
    for _ in range(1500):  # the router picks the least busy replica by its last report
        info = handle.replica_stats.remote().result()
        seen[info.identity] = info.stats.prompt_tokens_computed
        if len(seen) == n:
            return sum(seen.values())
        time.sleep(0.02)
    raise RuntimeError(f"could not reach all {n} prefill replicas of {app}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--prefill-replicas", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=336, help="per prefill replica")
    ap.add_argument("--redis-url", default=None, help="prefix index in Redis (default in-process)")
    ap.add_argument("--port", type=int, default=18610)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from ray import serve

    from services.app import build_app
    from services.config import load_config

    p = args.prefill_replicas
    start_cluster({"prefill_pool": 2 * p, "decode_pool": 2}, args.port)
    base = f"http://127.0.0.1:{args.port}"
    policies = {"least_loaded": "/loaded", "prefix_aware": "/aware"}
    for policy, prefix in policies.items():
        over = {
            "routing": policy,
            "redis_url": args.redis_url,
            "prefill": {"replicas": p, "num_kv_blocks": args.kv_blocks},
            "decode": {"num_kv_blocks": 2048},
        }
        serve.run(
            build_app(load_config(overrides=over, environ={})),
            name=policy,
            route_prefix=prefix,
        )

    rng = random.Random(0)
    systems = [
        [rng.randrange(100, 40000) for _ in range(args.system_tokens)] for _ in range(args.prompts)
    ]
    reqs: list[tuple[list[int], int]] = []
    owners: list[int] = []
    for _ in range(args.rounds):
        order = list(range(args.prompts))
        rng.shuffle(order)
        for k in order:
            user = [rng.randrange(100, 40000) for _ in range(args.user_tokens)]
            reqs.append((systems[k] + user, args.max_tokens))
            owners.append(k)
    prompt_tokens = sum(len(r[0]) for r in reqs)
    # ideal: each system prompt computed once in the cluster; later turns reuse its full blocks
    reusable = args.system_tokens // BLOCK * BLOCK
    ideal_hit = (len(reqs) - args.prompts) * reusable
    print(
        f"{len(reqs)} requests: {args.prompts} system prompts x {args.system_tokens} tokens, "
        f"{args.rounds} rounds of {args.user_tokens}-token user turns, concurrency "
        f"{args.concurrency}; {p} prefill replicas x {args.kv_blocks} KV blocks, 1 decode; "
        f"index: {'redis' if args.redis_url else 'in-process'}",
        flush=True,
    )
    rows: dict[str, dict[str, float]] = {}
    for policy, prefix in policies.items():
        url = f"{base}{prefix}/v1/completions"
        asyncio.run(closed_loop(url, [([7] * 40, 2)], 1))  # warm-up, no shared prefix
        before = prefill_computed(policy, p)
        results = asyncio.run(closed_loop(url, reqs, args.concurrency))
        computed = prefill_computed(policy, p) - before
        hit = sum(int(r["cached_tokens"]) for r in results)  # type: ignore[call-overload]
        ttft = [float(r["ttft"]) for r in results]  # type: ignore[arg-type]
        rows[policy] = row = {
            "hit_rate_tokens": hit / prompt_tokens,
            "hit_rate_requests": sum(1 for r in results if r["cached_tokens"]) / len(results),
            "ideal_hit_rate_tokens": ideal_hit / prompt_tokens,
            "of_ideal": hit / ideal_hit,
            "prefill_tokens_computed": computed,
            "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99),
        }
        print(
            f"{policy:>13}: hit rate {row['hit_rate_tokens']:.3f} tokens "
            f"({row['of_ideal']:.2f} of ideal {row['ideal_hit_rate_tokens']:.3f}), "
            f"{row['hit_rate_requests']:.2f} requests; prefill tokens computed {computed:,} "
            f"of {prompt_tokens:,}; TTFT p50/p99 {row['ttft_p50'] * 1e3:,.0f}/"
            f"{row['ttft_p99'] * 1e3:,.0f} ms",
            flush=True,
        )
    a, b = rows["prefix_aware"], rows["least_loaded"]
    print(
        f"prefix-aware vs least-loaded: TTFT p50 {b['ttft_p50'] / a['ttft_p50']:.2f}x better, "
        f"p99 {b['ttft_p99'] / a['ttft_p99']:.2f}x; prefill tokens computed "
        f"{a['prefill_tokens_computed'] / max(b['prefill_tokens_computed'], 1):.2f}x"
    )
    finish(rows, args.json)


if __name__ == "__main__":
    main()
