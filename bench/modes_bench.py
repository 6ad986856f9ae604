"""Where disaggregation pays (issue 23): goodput per replica of disaggregated and colocated
serving across prompt/output mixes and SLOs, DistServe's way, in the simulator
(``services/autoscale/modes.py``) with measured per-token costs. Deterministic.

    .venv/bin/python bench/modes_bench.py [--plot bench/plots/disagg_vs_colocated.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.autoscale.modes import goodput_per_replica
from services.autoscale.simulator import Costs

# SmolLM2-135M-Instruct, pdserve's default precision (Q4_1 weights, bf16 prompt GEMMs), one
# thread on the 2-core Xeon with AMX: BENCHMARKS.md, engine bench of 2026-12-06 (second
# session): TTFT 69 / 232 / 1,382 ms at 128 / 512 / 2,048 tokens; decode steps 17.8 / 42.9 /
# 85.1 ms at batch 1 / 8 / 32.
CPU = Costs(
    prefill_points=((128, 0.069), (512, 0.232), (2048, 1.382)),
    step_points=((1, 0.0178), (8, 0.0429), (32, 0.0851)),
    transfer_s=0.01,
)
MIXES = [(128, 512), (256, 128), (512, 64), (1024, 128), (2048, 32)]  # (prompt, output)
SLOS = [(1.0, 0.05), (3.0, 0.1)]  # (TTFT s, mean ITL s)
REPLICAS = (2, 4)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print("| prompt / output | SLO TTFT / ITL | replicas | disaggregated | colocated | better |")
    print("| --- | --- | --- | --- | --- | --- |")
    for prompt, output in MIXES:
        for ttft, itl in SLOS:
            for n in REPLICAS:
                d = goodput_per_replica("disaggregated", n, CPU, prompt, output, ttft, itl)
                c = goodput_per_replica("colocated", n, CPU, prompt, output, ttft, itl)
                better = "-" if d == c == 0 else ("disaggregated" if d > c else "colocated")
                ratio = f" ({max(d, c) / min(d, c):.2f}x)" if min(d, c) > 0 else ""
                print(f"| {prompt} / {output} | {ttft:g} s / {itl * 1e3:g} ms | {n} | {d:.2f} | "
                      f"{c:.2f} | {better}{ratio} |")  # fmt: skip
                rows.append(dict(prompt=prompt, output=output, slo_ttft=ttft, slo_itl=itl,
                                 replicas=n, disaggregated=d, colocated=c))  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.plot:
        from services.loadgen.plots import _pyplot

        plt = _pyplot()
        fig, axes = plt.subplots(1, len(SLOS), figsize=(11, 3.8), sharey=True)
        labels = [f"{p}/{o}" for p, o in MIXES]
        for ax, (ttft, itl) in zip(axes, SLOS):
            for mode, mark in (("disaggregated", "o-"), ("colocated", "s--")):
                ys = [next(r[mode] for r in rows if (r["prompt"], r["output"]) == mix
                           and r["slo_ttft"] == ttft and r["replicas"] == 4) for mix in MIXES]  # fmt: skip
                ax.plot(labels, ys, mark, label=mode)
            ax.set_title(f"4 replicas, SLO TTFT {ttft:g} s, ITL {itl * 1e3:g} ms")
            ax.set_xlabel("prompt / output tokens")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("goodput per replica (req/s)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
