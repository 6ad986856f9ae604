"""SLO autoscaling in the simulator: the planner against fixed allocations, on step, ramp,
burst and diurnal traces (services.autoscale.simulator; costs from the engine benchmark).

For each trace: SLO attainment (TTFT and mean ITL both within target) of the requests after
the transition window, and replica-seconds, for the planner and for the smallest fixed
allocation that meets the SLO on the same requests (sized for the peak). Deterministic.

    .venv/bin/python bench/autoscale_sim.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.autoscale.planner import PoolTarget
from services.autoscale.simulator import Costs, simulate, trace

TTFT_S, ITL_S = 2.0, 0.07
COSTS = Costs()
PREFILL = PoolTarget(
    "ttft", TTFT_S, 1, 8, up_cooldown_s=20, down_cooldown_s=60, queued_tokens_per_replica=1024
)
DECODE = PoolTarget("itl", ITL_S, 1, 8, up_cooldown_s=20, down_cooldown_s=60)
DURATION = 900.0
TRACES = {  # kind -> (base rps, peak rps, settled from: requests before this are not scored)
    "step": (0.2, 1.2, DURATION / 3 + COSTS.startup_s + 10),
    "ramp": (0.1, 1.5, 0.0),
    "burst": (0.3, 1.5, 0.0),
    "diurnal": (0.1, 1.5, 0.0),
}


def smallest_fixed(requests, since, goal):  # type: ignore[no-untyped-def]
    """The cheapest fixed (prefill, decode) allocation whose attainment reaches ``goal``."""
    best = None
    for p in range(1, 9):
        for d in range(1, 9):
            r = simulate(requests, COSTS, prefill=p, decode=d)
            att = r.attainment(TTFT_S, ITL_S, since)
            cost = sum(r.replica_seconds.values())
            if att >= goal and (best is None or cost < best[2]):
                best = (p, d, cost, att)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print(
        f"SLO met: TTFT <= {TTFT_S} s and mean ITL <= {1000 * ITL_S:.0f} ms per request"
        f" (the planner holds the p90s to these targets); {DURATION:.0f} s traces"
    )
    print(
        "trace    | planner: SLO met, replica-s (max P/D) | fixed for peak: P/D, SLO met, replica-s | replica-s ratio"
    )
    for kind, (base, peak, since) in TRACES.items():
        reqs = trace(kind, DURATION, base, peak, prompt_tokens=256, output_tokens=128, seed=1)
        auto = simulate(reqs, COSTS, prefill=PREFILL, decode=DECODE)
        att = auto.attainment(TTFT_S, ITL_S, since)
        cost = sum(auto.replica_seconds.values())
        mp, md = max(t[1] for t in auto.timeline), max(t[2] for t in auto.timeline)
        fixed = smallest_fixed(reqs, since, min(att, 0.99))
        assert fixed is not None
        fp, fd, fcost, fatt = fixed
        rows.append(
            {
                "trace": kind,
                "requests": len(reqs),
                "planner": {"slo": att, "replica_s": cost, "max": [mp, md]},
                "fixed": {"slo": fatt, "replica_s": fcost, "replicas": [fp, fd]},
                "ratio": cost / fcost,
            }
        )
        print(
            f"{kind:8} | {100 * att:5.1f}%, {cost:7.0f} ({mp}/{md})"
            f"            | {fp}/{fd}, {100 * fatt:5.1f}%, {fcost:7.0f}"
            f"                  | {cost / fcost:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
