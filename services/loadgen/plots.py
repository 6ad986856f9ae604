"""PNG plots of bench runs (matplotlib, no display): latency CDFs, and a rate sweep of goodput
and p99 latencies against request rate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only; never a window, whatever the environment says
    import matplotlib.pyplot as plt

    return plt


def cdfs(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    """TTFT, ITL and E2E CDFs, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "E2E")):
        for run in runs:
            xs = sorted(_values(run, key))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=run["label"])
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of tokens")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    """Goodput and p99 TTFT / TPOT against the offered rate (open-loop runs)."""
    plt = _pyplot()
    pts = sorted((r["rate"], r["summary"]) for r in runs if r.get("rate") is not None)
    rates = [p[0] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(rates, [s["goodput"] for _, s in pts], "o-", label="goodput")
    a.plot(rates, [s["request_throughput"] for _, s in pts], "s--", label="throughput")
    a.plot(rates, rates, ":", color="grey", label="offered")
    a.set_xlabel("request rate (1/s)")
    a.set_ylabel("requests/s")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    b.plot(rates, [s["ttft_s"]["p99"] for _, s in pts], "o-", label="TTFT p99 (s)")
    b.plot(rates, [s["tpot_s"]["p99"] * 10 for _, s in pts], "s-", label="TPOT p99 (x10 s)")
    slo = pts[0][1]["slo"] if pts else {}
    if slo:
        b.axhline(slo["ttft_s"], color="C0", ls=":", lw=1)
        b.axhline(slo["tpot_s"] * 10, color="C1", ls=":", lw=1)
    b.set_xlabel("request rate (1/s)")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _values(run: dict[str, Any], key: str) -> list[float]:
    out: list[float] = []
    for r in run["records"]:
        if r["error"] is not None:
            continue
        if key == "itl_s":
            out.extend(r["itls"])
        elif r[key] is not None:
            out.append(r[key])
    return out
