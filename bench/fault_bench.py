"""Fault bench: steady streamed load on a real cluster while faults are injected, and what each
fault did to the requests.

Starts a local Ray cluster, a real ``redis-server`` (the prefix index) and one pdserve app
(2 prefill + 2 decode replicas, KV over gRPC), then runs one fault-free pass over a fixed set
of requests (prompt, seed; temperature 0.8, ``ignore_eos``) to get each request's reference
tokens, and then each scenario over the same requests:

    0. steady        no fault: the control (the same load by itself)
    a. decode-kill   a decode replica is killed (no goodbye) every ``--kill-every-s``
    b. prefill-kill  a prefill replica is killed once, early in the run
    c. redis-restart the prefix index's redis-server is killed and started again
    d. corrupt-kv    prefill replicas flip a bit in their next KV data messages
    e. cancel-storm  100 clients at once, each disconnecting at a random point
    f. overload      3x as many clients as the gateway admits (``max_inflight_requests``)

Per scenario: requests completed, resumed (the gateway's ``pdserve_resumes`` counter),
refused with 429, failed with an explicit error, cancelled by their client; streams silently
truncated (a success end with tokens missing: must be 0); requests whose tokens differ from
the fault-free run of the same seed (tokens lost or duplicated: must be 0; a cancelled or
failed stream must carry a prefix of them); KV blocks still referenced and gateway slots still
taken once the cluster is idle again (leaked: must be 0); TTFT / ITL p99 and goodput
(completed requests within ``--slo-ttft-s`` and ``--slo-itl-s`` per second).

    OMP_NUM_THREADS=1 .venv/bin/python bench/fault_bench.py [--scenarios a,b,c,d,e,f] \\
        [--requests 24] [--clients 4] [--json out.json]

The harness (``run_requests``, ``judge``, ``Faults``) is shared with tests/cluster/test_faults.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving_bench import pct  # noqa: E402
from tests.fixtures import start_redis  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = [
    "a lighthouse keeper who collects storms",
    "the history of the bicycle",
    "how bread rises",
    "a robot learning to paint",
    "the migration of arctic terns",
    "why the sky is blue at noon and red at dusk",
    "a market town on market day",
    "the first expedition to the deep sea",
]


# ---- requests and what became of them ---------------------------------------------------------
@dataclass(frozen=True)
class Req:
    prompt: int  # index into the prompt list
    seed: int
    cancel_after: int | None = None  # the client disconnects after this many tokens

    @property
    def key(self) -> tuple[int, int]:
        return (self.prompt, self.seed)


@dataclass
class Outcome:
    req: Req
    status: str  # completed | refused | failed | cancelled | truncated
    tokens: list[int] = field(default_factory=list)
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str = ""
    retry_after_s: float = 0.0  # a 429's hint


def prompts_for(n: int) -> list[str]:
    return [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


async def one(
    client: httpx.AsyncClient,
    base: str,
    prompts: list[str],
    req: Req,
    max_tokens: int,
    retry_429_s: float = 0.0,
) -> Outcome:
    """One streamed completion, classified. A success end ([DONE] after a finish reason) with
    fewer tokens than asked (``ignore_eos``) is a silent truncation; an end without [DONE] and
    without an error event too. A 429 is retried after its Retry-After for ``retry_429_s``
    (as an SDK client does), then counted as refused."""
    give_up = time.monotonic() + retry_429_s
    while True:
        out = await _one(client, base, prompts, req, max_tokens)
        if out.status != "refused" or time.monotonic() >= give_up:
            return out
        await asyncio.sleep(out.retry_after_s)  # the client's back-off, as the server asked


async def _one(
    client: httpx.AsyncClient, base: str, prompts: list[str], req: Req, max_tokens: int
) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": prompts[req.prompt],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": req.seed,
        "ignore_eos": True,
        "stream": True,
    }
    out = Outcome(req, "truncated")
    t0 = time.perf_counter()
    last = t0
    finish: str | None = None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            if r.status_code == 429:
                out.status = "refused"
                out.retry_after_s = float(r.headers.get("retry-after", "1"))
                return out
            if r.status_code != 200:
                await r.aread()
                out.status, out.error = "failed", f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            if req.cancel_after == 0:
                out.status = "cancelled"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.status = (
                        "completed" if finish and len(out.tokens) == max_tokens else "truncated"
                    )
                    return out
                event = json.loads(line[6:])
                if "error" in event:
                    out.status, out.error = "failed", str(event["error"].get("message", event))
                    return out
                now = time.perf_counter()
                for ch in event.get("choices", []):
                    for t in ch.get("token_ids", []):
                        if out.ttft is None:
                            out.ttft = now - t0
                        else:
                            out.itls.append(now - last)
                        last = now
                        out.tokens.append(t)
                    finish = ch.get("finish_reason") or finish
                if req.cancel_after is not None and len(out.tokens) >= req.cancel_after:
                    out.status = "cancelled"
                    return out  # leaving the context closes the connection mid-stream
    except httpx.HTTPError as e:  # the connection broke: the client knows (not silent)
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    return out


async def run_requests(
    base: str,
    prompts: list[str],
    reqs: list[Req],
    clients: int,
    max_tokens: int,
    retry_429_s: float = 0.0,
    duration_s: float | None = None,
) -> tuple[list[Outcome], float]:
    """``clients`` closed-loop clients work through ``reqs`` in order, once; with
    ``duration_s``, over and over until it has passed (steady load; a refused client waits
    out the Retry-After before its next request). Returns the outcomes and the wall time."""
    todo = itertools.cycle(reqs) if duration_s is not None else iter(reqs)
    end = None if duration_s is None else time.monotonic() + duration_s
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker() -> None:
            # NOTE: one event loop: workers take from the shared iterator in turn
            for r in todo:
                if end is not None and time.monotonic() >= end:
                    return
                o = await one(client, base, prompts, r, max_tokens, retry_429_s)
                outcomes.append(o)
                if end is not None and o.status == "refused":
                    await asyncio.sleep(o.retry_after_s)  # the client's back-off

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return outcomes, wall


def judge(
    outcomes: list[Outcome],
    reference: dict[tuple[int, int], list[int]],
    wall: float,
    slo_ttft_s: float = 3.0,
    slo_itl_s: float = 0.5,
) -> dict[str, Any]:
    """Counts per status, and the token checks against the fault-free ``reference``: a
    completed request must carry exactly its reference tokens, a cancelled or failed one a
    prefix of them (``mismatched``: otherwise; ``tokens_lost`` / ``tokens_duplicated``: the
    difference past the common prefix)."""
    row: dict[str, Any] = {
        s: 0 for s in ("completed", "refused", "failed", "cancelled", "truncated")
    }
    lost = extra = mismatched = 0
    for o in outcomes:
        row[o.status] += 1
        want = reference[o.req.key]
        common = next((i for i, (a, b) in enumerate(zip(o.tokens, want)) if a != b), None)
        common = min(len(o.tokens), len(want)) if common is None else common
        whole = o.status == "completed"
        if (whole and o.tokens != want) or (not whole and common < len(o.tokens)):
            mismatched += 1
            extra += len(o.tokens) - common
            lost += (len(want) - common) if whole else 0
    done = [o for o in outcomes if o.status == "completed"]
    good = [
        o
        for o in done
        if (o.ttft or 0) <= slo_ttft_s and (sum(o.itls) / max(1, len(o.itls))) <= slo_itl_s
    ]
    row |= {
        "requests": len(outcomes),
        "mismatched": mismatched,
        "tokens_lost": lost,
        "tokens_duplicated": extra,
        "ttft_p99_s": pct([o.ttft for o in outcomes if o.ttft is not None], 99),
        "itl_p99_s": pct([g for o in outcomes for g in o.itls], 99),
        "goodput_req_s": len(good) / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }
    return row


def counter(base: str, name: str) -> float:
    """Sum of a metric's series on the gateway's /metrics (0 when absent)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pat.findall(text))


# ---- faults: what the bench does to the cluster ------------------------------------------------
class Faults:
    """Replicas of one app, reached through Ray: kill one, inject corruption, and check that
    an idle cluster holds nothing (blocks, held KV, gateway slots)."""

    def __init__(self, app: str, base: str, replicas: dict[str, int], seed: int = 0) -> None:
        self.app, self.base, self.replicas = app, base, replicas
        self.rng = random.Random(seed)

    def _actors(self, deployment: str) -> list[str]:
        import ray

        return [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{self.app}#{deployment}#")
        ]

    def kill(self, deployment: str) -> str:
        """Kill one replica of ``deployment`` as SIGKILL would (no drain, no goodbye; Serve
        starts a replacement); returns its actor name."""
        import ray

        name = self.rng.choice(sorted(self._actors(deployment)))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def corrupt(self, n: int) -> None:
        """Every prefill replica flips a bit in its next ``n`` KV data messages (the router
        picks which replica gets each call: ask until every replica said yes)."""
        from ray import serve

        handle = serve.get_deployment_handle("prefill", app_name=self.app)
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < self.replicas["prefill"] and time.monotonic() < deadline:
            seen.add(handle.corrupt_next_kv_pieces.remote(n).result())

    def wait_running(self, timeout_s: float = 300) -> None:
        """Until every deployment has its replicas running again (after kills)."""
        from ray import serve

        deadline = time.monotonic() + timeout_s
        while True:
            app = serve.status().applications.get(self.app)
            states = {
                name: d.replica_states.get("RUNNING", 0)
                for name, d in (app.deployments.items() if app else [])
            }
            if all(states.get(d, 0) >= n for d, n in self.replicas.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not all running: {states}")
            time.sleep(0.5)  # polling Serve's controller; not test synchronization

    def idle_state(self) -> dict[str, int]:
        """Summed over every replica: requests running / waiting / KV held, blocks referenced;
        and the gateway's slots taken."""
        from ray import serve

        total = {"running": 0, "waiting": 0, "held": 0, "blocks_used": 0}
        for deployment, n in self.replicas.items():
            handle = serve.get_deployment_handle(deployment, app_name=self.app)
            seen: dict[str, Any] = {}
            deadline = time.monotonic() + 30
            while len(seen) < n and time.monotonic() < deadline:
                info = handle.replica_stats.remote().result()
                seen[info.identity] = info.stats
            for s in seen.values():
                total["running"] += s.num_running
                total["waiting"] += s.num_waiting
                total["held"] += s.num_held
                total["blocks_used"] += s.blocks_used
        total["gateway_slots"] = int(counter(self.base, "pdserve_gateway_inflight_requests"))
        return total

    def leaks_after_drain(self, hold_timeout_s: float) -> dict[str, int]:
        """Once no request runs, waits out the KV hold timeout (a decode replica killed
        before it released its pull leaves the KV held until then) and returns what is still
        taken: every count must be 0."""
        self.wait_running()
        deadline = time.monotonic() + hold_timeout_s + 30
        while True:
            state = self.idle_state()
            if not any(state.values()) or time.monotonic() > deadline:
                return state
            time.sleep(1.0)  # polling the replicas' stats; not test synchronization


class Redis:
    """A redis-server this process started (the prefix index); ``restart`` kills it by its
    pid and starts it again on the same port (the index is empty after)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{port}/0"

    def start(self) -> None:
        self.proc = start_redis(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self, down_s: float = 2.0) -> None:
        self.stop()
        time.sleep(down_s)  # the outage itself
        self.start()


# ---- scenarios -------------------------------------------------------------------------------
@dataclass
class Scenario:
    """A load and the fault injected beside it."""

    name: str
    what: str
    reqs: list[Req]  # worked through once, or cycled for ``duration_s``
    clients: int
    # runs on a thread beside the load; returns once ``done`` is set (the load is over)
    inject: Callable[[Faults, Redis | None, threading.Event], None] | None = None
    duration_s: float | None = None  # steady load this long; None: ``reqs`` once
    retry_429_s: float = 0.0  # clients retry a 429 (after Retry-After) this long


def _decode_kills(every_s: float) -> Callable[[Faults, Redis, threading.Event], None]:
    def run(f: Faults, _r: Redis, done: threading.Event) -> None:
        while not done.wait(every_s):  # the fault's schedule
            print(f"    killed {f.kill('decode')}", flush=True)

    return run


def _once(
    at_s: float, act: Callable[[Faults, Redis], None]
) -> Callable[[Faults, Redis, threading.Event], None]:
    def run(f: Faults, r: Redis, done: threading.Event) -> None:
        if not done.wait(at_s):  # the fault's schedule
            act(f, r)

    return run


def scenarios(args: argparse.Namespace, reqs: list[Req]) -> dict[str, Scenario]:
    every, steady, at = args.kill_every_s, args.duration_s, 5.0
    return {
        "0": Scenario(
            "steady",
            "no fault (the control: what the same steady load does by itself)",
            reqs,
            args.clients,
            duration_s=steady,
        ),
        "a": Scenario(
            "decode-kill",
            f"a decode replica killed every {every:.0f} s",
            reqs,
            args.clients,
            _decode_kills(every),
            duration_s=3 * every + 5,
        ),
        "b": Scenario(
            "prefill-kill",
            f"a prefill replica killed once, {at:.0f} s in",
            reqs,
            args.clients,
            _once(at, lambda f, _r: print(f"    killed {f.kill('prefill')}", flush=True)),
            duration_s=steady,
        ),
        "c": Scenario(
            "redis-restart",
            f"the prefix index's redis-server killed {at:.0f} s in, back 2 s later",
            reqs,
            args.clients,
            _once(at, lambda _f, r: r.restart() if r is not None else None),
            duration_s=steady,
        ),
        "d": Scenario(
            "corrupt-kv",
            f"each prefill replica flips a bit in its next 2 KV data messages, {at:.0f} s in",
            reqs,
            args.clients,
            _once(at, lambda f, _r: f.corrupt(2)),
            duration_s=steady,
        ),
        "e": Scenario(
            "cancel-storm",
            "100 clients at once, each disconnecting at a random point",
            _cancelling(reqs, 100, args.max_tokens),
            100,
            retry_429_s=300.0,  # every client gets in (the gateway admits fewer), then leaves
        ),
        "f": Scenario(
            "overload",
            f"{3 * args.max_inflight} clients: 3x as many as the gateway admits",
            reqs,
            3 * args.max_inflight,
            duration_s=steady,
        ),
    }


def _cancelling(reqs: list[Req], n: int, max_tokens: int) -> list[Req]:
    rng = random.Random(7)
    return [
        Req(reqs[i % len(reqs)].prompt, reqs[i % len(reqs)].seed, rng.randrange(0, max_tokens))
        for i in range(n)
    ]


# the gateway's counters of requests it carried through a fault
RECOVERIES = {"resumed": "pdserve_resumes_total", "reprefilled": "pdserve_kv_reprefills_total"}


async def with_fault(
    sc: Scenario,
    faults: Faults,
    redis_: Redis | None,
    base: str,
    prompts: list[str],
    max_tokens: int,
) -> tuple[list[Outcome], float]:
    """The scenario's load, with its fault injected beside it on a thread (blocking Ray
    calls); the fault stops once the load is over."""
    done = threading.Event()
    injector = (
        asyncio.create_task(asyncio.to_thread(sc.inject, faults, redis_, done))
        if sc.inject is not None
        else None
    )
    try:
        return await run_requests(
            base, prompts, sc.reqs, sc.clients, max_tokens, sc.retry_429_s, sc.duration_s
        )
    finally:
        done.set()
        if injector is not None:
            await injector


# ---- the bench -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenarios", default="0,a,b,c,d,e,f", help="0 = the no-fault control")
    ap.add_argument("--requests", type=int, default=24, help="distinct (prompt, seed) requests")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients (steady load)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kill-every-s", type=float, default=20.0)
    ap.add_argument("--duration-s", type=float, default=30.0, help="steady load per scenario")
    ap.add_argument("--max-inflight", type=int, default=16, help="the gateway's admission limit")
    ap.add_argument("--hold-timeout-s", type=float, default=10.0)
    ap.add_argument("--slo-ttft-s", type=float, default=3.0)
    ap.add_argument("--slo-itl-s", type=float, default=0.5)
    ap.add_argument(
        "--by-size",
        action="store_true",
        help="serve with batch_invariant false (kernels by step size): faster above 16 rows, "
        "but a seeded request's tokens can depend on its batch",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="the model dtype (auto: bf16 on hosts with native bf16, whose torch backend is "
        "not batch-invariant; float32: the cpu backend, batch-invariant by row role)",
    )
    ap.add_argument("--port", type=int, default=18531)
    ap.add_argument("--json")
    args = ap.parse_args()

    from ray import serve

    sys.path.insert(0, str(REPO / "bench"))
    from serving_bench import finish, start_cluster

    from services.app import build_app
    from services.config import load_config
    from tests.fixtures import free_port

    base = f"http://127.0.0.1:{args.port}"
    redis_ = Redis(free_port())
    redis_.start()
    start_cluster({"prefill_pool": 8, "decode_pool": 8}, args.port)
    pools = {"replicas": 2, "num_kv_blocks": 512, "max_num_seqs": 8}
    cfg = load_config(
        overrides={
            "grpc_port": 0,
            "prefill": pools,
            "decode": pools,
            "redis_url": redis_.url,
            "kv_hold_timeout_s": args.hold_timeout_s,
            "max_inflight_requests": args.max_inflight,
            "batch_invariant": "auto" if not args.by_size else False,
            "dtype": args.dtype,
        },
        environ={},
    )
    rows: dict[str, dict[str, Any]] = {}
    try:
        serve.run(build_app(cfg), name="faults", route_prefix="/", blocking=False)
        faults = Faults("faults", base, {"prefill": 2, "decode": 2})
        faults.wait_running()
        while httpx.get(f"{base}/ready", timeout=30).status_code != 200:
            time.sleep(1)  # polling a server we started; not test synchronization
        prompts = prompts_for(len(TOPICS))
        base_reqs = [Req(i % len(prompts), 1000 + i) for i in range(args.requests)]

        print(f"fault-free pass: {len(base_reqs)} requests, {args.clients} clients", flush=True)
        outcomes, wall = asyncio.run(
            run_requests(base, prompts, base_reqs, args.clients, args.max_tokens)
        )
        bad = [o for o in outcomes if o.status != "completed"]
        if bad:
            raise RuntimeError(f"the fault-free pass did not complete: {bad[0]}")
        reference = {o.req.key: o.tokens for o in outcomes}
        rows["none"] = judge(outcomes, reference, wall, args.slo_ttft_s, args.slo_itl_s)
        rows["none"] |= {k: 0 for k in RECOVERIES} | faults.leaks_after_drain(args.hold_timeout_s)
        print(f"  {rows['none']}", flush=True)

        table = scenarios(args, base_reqs)
        for key in args.scenarios.split(","):
            sc = table[key]
            load = f"{sc.duration_s:.0f} s" if sc.duration_s else f"{len(sc.reqs)} requests"
            print(f"{key}. {sc.name}: {sc.what}; {load}, {sc.clients} clients", flush=True)
            before = {m: counter(base, m) for m in RECOVERIES.values()}
            outcomes, wall_s = asyncio.run(
                with_fault(sc, faults, redis_, base, prompts, args.max_tokens)
            )
            row = judge(outcomes, reference, wall_s, args.slo_ttft_s, args.slo_itl_s)
            row |= {k: int(counter(base, m) - before[m]) for k, m in RECOVERIES.items()}
            row |= faults.leaks_after_drain(args.hold_timeout_s)
            rows[sc.name] = row
            print(f"  {row}", flush=True)
    finally:
        print_table(rows)
        finish(rows, args.json)
        redis_.stop()


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    cols = [
        ("requests", "requests"), ("completed", "completed"), ("resumed", "resumed"),
        ("reprefilled", "re-prefilled"),
        ("refused", "429"), ("failed", "explicit error"), ("cancelled", "cancelled"),
        ("truncated", "silently truncated"), ("mismatched", "differ from fault-free pass (requests)"),
        ("blocks_used", "blocks leaked"), ("held", "KV held"), ("gateway_slots", "slots leaked"),
        ("ttft_p99_s", "TTFT p99 s"), ("itl_p99_s", "ITL p99 s"), ("goodput_req_s", "goodput req/s"),
    ]  # fmt: skip
    print("\n| scenario | " + " | ".join(c for _, c in cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for name, row in rows.items():
        cells = [
            f"{row.get(k, 0):.2f}" if isinstance(row.get(k), float) else str(row.get(k, 0))
            for k, _ in cols
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
