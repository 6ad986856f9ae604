"""A run's figures from its records: percentiles of TTFT, TPOT, ITL and E2E, throughput, and
goodput under SLOs (DistServe's: requests per second that met both the TTFT and the per-output-
token SLO; a request's TPOT stands for its ITL, since users feel its mean pace)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.loadgen.client import Record

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: Sequence[float]) -> dict[str, float]:
    out = {"mean": sum(xs) / len(xs) if xs else math.nan}
    out.update({f"p{p}": percentile(xs, p) for p in PERCENTILES})
    return out


def meets(r: Record, slo: Slo) -> bool:
    if not r.ok or r.ttft_s is None or r.ttft_s > slo.ttft_s:
        return False
    tpot = r.tpot_s
    return tpot is None or tpot <= slo.tpot_s


def summarize(records: Sequence[Record], duration_s: float, slo: Slo) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets(r, slo)]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "duration_s": duration_s,
        "input_tokens": _dist([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "output_tokens": _dist([r.output_tokens for r in ok]),
        "ttft_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _dist([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_s": _dist([x for r in ok for x in r.itls]),
        "e2e_s": _dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else math.nan,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "slo_attainment": len(good) / len(records) if records else math.nan,
        "goodput": len(good) / duration_s if duration_s > 0 else math.nan,
    }


def table(runs: Sequence[dict[str, Any]]) -> str:
    """The terminal summary: one row per run."""
    head = (
        f"{'run':>16} {'done':>7} {'tok/s':>8} {'goodput':>8} "
        f"{'TTFT p50/p99 s':>16} {'TPOT p50/p99 ms':>17} {'ITL p99 ms':>11} {'E2E p99 s':>10}"
    )
    lines = [head]
    for run in runs:
        s = run["summary"]
        lines.append(
            f"{run['label']:>16} {s['completed']:>3}/{s['requests']:<3} "
            f"{s['output_throughput']:>8.1f} {s['goodput']:>8.2f} "
            f"{s['ttft_s']['p50']:>7.3f}/{s['ttft_s']['p99']:<8.3f} "
            f"{s['tpot_s']['p50'] * 1e3:>8.1f}/{s['tpot_s']['p99'] * 1e3:<8.1f} "
            f"{s['itl_s']['p99'] * 1e3:>11.1f} {s['e2e_s']['p99']:>10.2f}"
        )
    return "\n".join(lines)
