"""``pdserve bench``: load any OpenAI-compatible endpoint and report what users would feel.

    pdserve bench --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --workload random --requests 64 --rate 0.5,1,2 --slo-ttft 2 --slo-tpot 0.1 \\
        --json bench.json --plots bench-plots/

One run per rate (Poisson, open loop) or per concurrency (closed loop), each over the same
seeded workload. Prints a table; writes the runs (summaries and every request) as JSON, and
PNG plots: latency CDFs, and the rate sweep when there are two rates or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.loadgen import client, stats
from services.loadgen import workload as wl


@dataclass(frozen=True, slots=True)
class BenchConfig:
    target: client.Target
    workload: str = "random"
    shape: wl.WorkloadConfig = field(default_factory=wl.WorkloadConfig)
    rates: tuple[float, ...] = ()
    concurrencies: tuple[int, ...] = ()
    slo: stats.Slo = field(default_factory=stats.Slo)
    seed: int = 0


def run_bench(cfg: BenchConfig, progress: bool = False) -> dict[str, Any]:
    """Every run of ``cfg``; returns the report (the JSON ``--json`` writes)."""
    convs = wl.build(cfg.workload, cfg.shape)
    n = sum(len(c.turns) for c in convs)
    plan = [client.Arrivals(rate=r, seed=cfg.seed) for r in cfg.rates] + [
        client.Arrivals(concurrency=c) for c in cfg.concurrencies
    ]
    if not plan:
        raise ValueError("give at least one --rate or --concurrency")
    runs = []
    for arrivals in plan:
        bar = _bar(n, arrivals.label()) if progress else None
        tick = None if bar is None else (lambda _r, b=bar: b.update(1))
        records, duration = asyncio.run(client.run(cfg.target, convs, arrivals, tick))
        if bar is not None:
            bar.close()
        runs.append(
            {
                "label": arrivals.label(),
                "rate": arrivals.rate,
                "concurrency": arrivals.concurrency,
                "summary": stats.summarize(records, duration, cfg.slo),
                "records": [r.as_dict() for r in records],
            }
        )
    return {
        "target": {"url": cfg.target.url, "model": cfg.target.model, "chat": cfg.target.chat},
        "workload": {
            "name": cfg.workload,
            "requests": n,
            "conversations": len(convs),
            "input_len": str(cfg.shape.input_len),
            "output_len": str(cfg.shape.output_len),
            "seed": cfg.shape.seed,
        },
        "slo": asdict(cfg.slo),
        "runs": runs,
    }


def _bar(total: int, label: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--model", required=True, help="the model id the server answers to")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions (else completions)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--workload", default="random", choices=sorted(wl.WORKLOADS))
    p.add_argument("--requests", type=int, default=32, help="requests per run (turns, in all)")
    p.add_argument("--input-len", default="normal:256:64", help="prompt tokens (random)")
    p.add_argument("--output-len", default="normal:64:16", help="output tokens (random)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (multiturn)")
    p.add_argument("--system-len", type=int, default=512, help="shared system prompt (multiturn)")
    p.add_argument("--rate", default="", help="requests/s, Poisson; comma-separated for a sweep")
    p.add_argument("--concurrency", default="", help="closed-loop clients; comma-separated")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="time per output token SLO, s")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers without vLLM's extension)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    shape = wl.WorkloadConfig(
        requests=a.requests,
        input_len=wl.Length.parse(a.input_len, "--input-len"),
        output_len=wl.Length.parse(a.output_len, "--output-len"),
        turns=a.turns,
        system_len=a.system_len,
        seed=a.seed,
    )
    target = client.Target(a.url, a.model, a.chat, a.api_key, not a.no_ignore_eos, a.temperature)
    return BenchConfig(
        target,
        a.workload,
        shape,
        tuple(float(x) for x in a.rate.split(",") if x),
        tuple(int(x) for x in a.concurrency.split(",") if x),
        stats.Slo(a.slo_ttft, a.slo_tpot),
        a.seed,
    )


def main(a: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(a)
        report = run_bench(cfg, progress=not a.no_progress and sys.stderr.isatty())
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    print(stats.table(report["runs"]))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.plots:
        from services.loadgen import plots

        folder = Path(a.plots)
        folder.mkdir(parents=True, exist_ok=True)
        written = [plots.cdfs(report["runs"], folder / "latency_cdf.png")]
        if sum(r["rate"] is not None for r in report["runs"]) >= 2:
            written.append(plots.sweep(report["runs"], folder / "rate_sweep.png"))
        print("plots: " + ", ".join(str(p) for p in written))
    failed = sum(r["summary"]["errors"] for r in report["runs"])
    if failed:
        print(f"pdserve bench: {failed} requests failed (see the report)", file=sys.stderr)
    return 1 if failed else 0
