"""``pdserve doctor``: the six latency questions answered for a live cluster (its own account
of itself plus a short probe load the doctor sends) or for a ``pdserve bench`` report.

    pdserve doctor --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct [--json out.json]
    pdserve doctor --bench bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.doctor import diagnosis, evidence
from services.loadgen import bench, client, stats, workload


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a live pdserve cluster's HTTP API")
    p.add_argument("--model", default=None, help="its model id (for the probe load)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--bench", default=None, help="a pdserve bench report instead of a probe")
    p.add_argument("--probe-requests", type=int, default=24)
    p.add_argument("--probe-concurrency", type=int, default=4)
    p.add_argument("--probe-input-len", default="normal:256:64")
    p.add_argument("--probe-output-len", default="normal:32:8")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--json", default=None, help="write the answers here")
    p.add_argument("--html", default=None, help="write a self-contained HTML report here")


def gather(a: argparse.Namespace) -> evidence.Evidence:
    if a.url is None and a.bench is None:
        raise ValueError("give --url (a live cluster) or --bench (a report)")
    runs = evidence.from_bench(a.bench).runs if a.bench else []
    cluster = None
    if a.url is not None:
        if not runs:  # the probe: the cluster's own requests, timed at the client
            if a.model is None:
                raise ValueError("--model is needed for the probe load")
            cfg = bench.BenchConfig(
                client.Target(a.url, a.model, api_key=a.api_key),
                "random",
                workload.WorkloadConfig(
                    requests=a.probe_requests,
                    input_len=workload.Length.parse(a.probe_input_len, "--probe-input-len"),
                    output_len=workload.Length.parse(a.probe_output_len, "--probe-output-len"),
                ),
                concurrencies=(a.probe_concurrency,),
                slo=stats.Slo(a.slo_ttft, a.slo_tpot),
            )
            runs = bench.run_bench(cfg)["runs"]
        # NOTE: after the load, so its steps are in the replicas' reports
        cluster = evidence.fetch_cluster(a.url, a.api_key)
    source = f"live cluster {a.url}" if a.url else f"bench report {a.bench}"
    return evidence.Evidence(source, cluster, runs)


def text(answers: list[diagnosis.Answer], source: str) -> str:
    lines = [f"pdserve doctor: {source}", ""]
    for ans in answers:
        mark = {"fine": "ok  ", "look here": ">>  ", "unknown": "??  "}[ans.verdict]
        lines.append(f"{mark}{ans.number}. {ans.question}: {ans.verdict.upper()}")
        figs = ", ".join(f"{k} {_fmt(v)}" for k, v in ans.figures.items())
        if figs:
            lines.append(f"      {figs}")
        if ans.cause:
            lines.append(f"      cause: {ans.cause}")
        if ans.action:
            lines.append(f"      action: {ans.action}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def main(a: argparse.Namespace) -> int:
    try:
        ev = gather(a)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pdserve doctor: {e}", file=sys.stderr)
        return 2
    answers = diagnosis.diagnose(ev, stats.Slo(a.slo_ttft, a.slo_tpot))
    print(text(answers, ev.source))
    if a.json:
        body = {"source": ev.source, "answers": [asdict(x) for x in answers]}
        Path(a.json).write_text(json.dumps(body, indent=1, default=str))
    if a.html:
        from services.doctor.html import render

        Path(a.html).write_text(render(answers, ev))
    return 0
