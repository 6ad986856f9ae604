"""What ``pdserve doctor`` reasons from: the cluster's own account of itself (``GET
/pdserve/doctor``: each engine replica's profile, counters and step costs) and requests timed at
the client (a short probe load the doctor sends itself, or a ``pdserve bench`` report)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class Evidence:
    source: str
    cluster: dict[str, Any] | None = None  # the /pdserve/doctor body; None: a bench file only
    runs: list[dict[str, Any]] = field(default_factory=list)  # pdserve bench runs

    # ---- the requests ---------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        return [r for run in self.runs for r in run["records"] if r["error"] is None]

    def concurrency(self) -> float:
        """The most requests the load kept in flight (closed loop: its clients; open loop: the
        peak of overlapping requests)."""
        best = 0.0
        for run in self.runs:
            if run.get("concurrency"):
                best = max(best, float(run["concurrency"]))
                continue
            spans = [
                (r["start_s"], r["start_s"] + r["e2e_s"])
                for r in run["records"]
                if r["e2e_s"] is not None
            ]
            for start, _ in spans:
                best = max(best, sum(1 for a, b in spans if a <= start < b))
        return best

    # ---- the engines ----------------------------------------------------------------------
    def replicas(self, pool: str) -> list[dict[str, Any]]:
        return list((self.cluster or {}).get("pools", {}).get(pool, ()))

    def all_replicas(self) -> list[dict[str, Any]]:
        return [r for p in (self.cluster or {}).get("pools", {}) for r in self.replicas(p)]

    def steps(self, pool: str) -> list[dict[str, Any]]:
        """The pool's step buckets, summed over its replicas."""
        merged: dict[tuple[int, bool], dict[str, Any]] = {}
        for rep in self.replicas(pool):
            for b in rep["steps"]:
                key = (b["rows"], b["with_prompt"])
                m = merged.setdefault(key, {**b, "steps": 0, "seconds": 0.0, "decode_rows": 0,
                                            "prompt_tokens": 0, "cpu_seconds": 0.0})  # fmt: skip
                for k in ("steps", "seconds", "decode_rows", "prompt_tokens"):
                    m[k] += b[k]
                # NOTE: NaN from a replica that does not report it (an older build): unknown
                m["cpu_seconds"] += b.get("cpu_seconds", math.nan)
        return [merged[k] for k in sorted(merged)]

    def stat(self, pool: str, name: str) -> float:
        return float(sum(r["stats"][name] for r in self.replicas(pool)))

    def profile(self, pool: str) -> dict[str, Any] | None:
        reps = self.replicas(pool)
        return reps[0]["profile"] if reps else None


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def from_bench(path: str | Path) -> Evidence:
    report = json.loads(Path(path).read_text())
    return Evidence(f"bench report {path}", None, report["runs"])


def fetch_cluster(url: str, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/pdserve/doctor", headers=headers, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"GET /pdserve/doctor: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()
