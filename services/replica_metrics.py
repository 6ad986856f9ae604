"""A replica's metrics: Prometheus series through Ray's own metrics export (every node's
metrics agent serves them, tagged with deployment and replica), and the sliding latency
windows the SLO autoscaler reads (``record_autoscaling_stats``).

Outside a Ray Serve replica (unit tests, one process) the Ray series are skipped and the
windows still work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from services.autoscale.window import LatencyWindow
from services.engine.engine import EngineStats
from services.engine.host_buffers import HOST_BUFFERS

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
BYTES_BUCKETS = [float(2**k) for k in range(16, 34, 2)]  # 64 KiB .. 8 GiB


class _RaySeries:
    def __init__(self) -> None:
        from ray.serve import metrics as m

        def hist(name: str, doc: str, buckets: list[float] = LATENCY_BUCKETS) -> Any:
            return m.Histogram(f"pdserve_replica_{name}", doc, boundaries=buckets)

        self.ttft = hist("ttft_seconds", "arrival at the replica to first token (prefill)")
        self.itl = hist("itl_seconds", "gaps between a request's tokens (decode)")
        self.e2e = hist("e2e_seconds", "arrival at the replica to last token")
        self.queue = hist("queue_seconds", "waiting for the first prefill step")
        self.prefill = hist("prefill_seconds", "prompt compute time")
        self.transfer = hist("kv_transfer_seconds", "KV pull time (decode)")
        self.transfer_bytes = hist("kv_transfer_bytes", "KV bytes pulled (decode)", BYTES_BUCKETS)
        self.gauges = {
            name: m.Gauge(f"pdserve_replica_{name}", doc)
            for name, doc in (
                ("running_requests", "requests in the running batch"),
                ("waiting_requests", "requests waiting for a slot"),
                ("kv_blocks_used", "KV blocks referenced by requests"),
                ("kv_blocks_free", "KV blocks free or evictable"),
                ("prefill_tokens_queued", "prompt tokens admitted, not computed yet"),
            )
        }
        self.prompt_tokens = m.Gauge("pdserve_replica_prompt_tokens_computed", "prefill work done")
        self.failures = m.Counter(
            "pdserve_replica_kv_transfer_failures",
            "failed KV pulls (decode), by reason: deadline, transfer, not_held, layout",
            tag_keys=("reason",),
        )
        self.kv_denied = m.Counter(
            "pdserve_replica_kv_denied",
            "KV transfer calls refused for a missing or wrong transfer secret (prefill)",
        )
        self.lease_expiries = m.Counter(
            "pdserve_replica_kv_lease_expiries",
            "held KV freed by its lease because no decode replica claimed it (prefill)",
        )
        self.transport_gbps = m.Gauge(
            "pdserve_replica_kv_transport_gbps",
            "the KV transport's bandwidth in the replica's start-up self-test",
            tag_keys=("transport",),
        )
        self.hit_tokens = m.Gauge("pdserve_replica_prefix_hit_tokens", "prompt tokens reused")
        self.join_waits = m.Gauge(
            "pdserve_replica_join_waits",
            "decode steps that waited for a request whose streamed KV was all in, so that it "
            "joined them (kv_join_wait_ms)",
        )
        self.join_wait_s = m.Gauge(
            "pdserve_replica_join_wait_seconds", "time decode steps waited for those requests"
        )
        self.host_buffers = m.Gauge(
            "pdserve_replica_kv_host_buffer_bytes",
            "host buffers of KV transfers: in_use (held by transfers and handles) and free "
            "(kept for reuse, bounded by kv_host_buffer_mb)",
            tag_keys=("state",),
        )


class ReplicaMetrics:
    """Args: window_s: the autoscaler's window; percentile: the one it reads."""

    def __init__(
        self, window_s: float, percentile: float = 0.9, busy_window_s: float = 60.0
    ) -> None:
        self.percentile = percentile
        self.busy_window_s = busy_window_s
        self._busy: deque[tuple[float, float]] = deque()  # (monotonic time, engine busy_s)
        self.self_test: Any = None
        self.ttft = LatencyWindow(window_s)
        self.itl = LatencyWindow(window_s)
        self._ray: _RaySeries | None = None
        try:
            from ray import serve

            serve.get_replica_context()
            self._ray = _RaySeries()
        except Exception:  # not in a Serve replica
            self._ray = None

    def observe_kv_denied(self, n: int) -> None:
        """``n`` more KV calls refused for their secret (prefill)."""
        if self._ray is not None and n:
            self._ray.kv_denied.inc(n)

    def observe_lease_expiries(self, n: int) -> None:
        """``n`` handoffs' KV freed by the lease, never claimed (prefill)."""
        if self._ray is not None and n:
            self._ray.lease_expiries.inc(n)

    def observe_first_token(self, ttft_s: float, queue_s: float, prefill_s: float) -> None:
        self.ttft.add(ttft_s)
        if self._ray is not None:
            self._ray.ttft.observe(ttft_s)
            self._ray.queue.observe(queue_s)
            self._ray.prefill.observe(prefill_s)

    def observe_gap(self, itl_s: float) -> None:
        self.itl.add(itl_s)
        if self._ray is not None:
            self._ray.itl.observe(itl_s)

    def observe_finish(self, e2e_s: float) -> None:
        if self._ray is not None:
            self._ray.e2e.observe(e2e_s)

    def observe_self_test(self, result: Any) -> None:
        """``kvtransfer.selftest.SelfTest``: which transport carries KV, at what GB/s."""
        self.self_test = result
        if self._ray is not None:
            self._ray.transport_gbps.set(result.gbps, tags={"transport": result.transport})

    def observe_transfer_failure(self, reason: str) -> None:
        if self._ray is not None:
            self._ray.failures.inc(tags={"reason": reason})

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        if self._ray is not None:
            self._ray.transfer.observe(seconds)
            self._ray.transfer_bytes.observe(float(nbytes))

    def busy(self, busy_s: float, now: float | None = None) -> float:
        """Fraction of the last ``busy_window_s`` the engine spent computing, from its
        cumulative busy time (sampled on every call)."""
        now = time.monotonic() if now is None else now
        b = self._busy
        b.append((now, busy_s))
        while len(b) > 2 and b[1][0] <= now - self.busy_window_s:
            b.popleft()
        (t0, b0), (t1, b1) = b[0], b[-1]
        return min(1.0, (b1 - b0) / (t1 - t0)) if t1 > t0 else 0.0

    def autoscaling_stats(self, s: EngineStats, busy_s: float) -> dict[str, float]:
        """What Ray Serve's controller receives for the SLO policy (services.autoscale.policy):
        TTFT and ITL percentiles over the window (0, with a count of 0, when empty; a pool's
        policy reads the one its target names), compute utilisation and the load signals."""
        out: dict[str, float] = {"busy": self.busy(busy_s)}
        for name, window in (("ttft", self.ttft), ("itl", self.itl)):
            p, n = window.snapshot(self.percentile)
            out[f"{name}_p"], out[f"{name}_n"] = p or 0.0, float(n)
        return out | {
            "queued_tokens": float(s.prefill_tokens_queued),
            "requests": float(s.num_running + s.num_waiting),
            "kv_usage": s.blocks_used / max(1, s.blocks_total),
        }

    def set_gauges(self, s: EngineStats, join_waits: int, join_wait_s: float) -> None:
        """``join_waits`` / ``join_wait_s``: the engine loop's waits for announced joins so
        far (``AsyncEngine.expect``)."""
        if self._ray is None:
            return
        g = self._ray.gauges
        g["running_requests"].set(s.num_running)
        g["waiting_requests"].set(s.num_waiting)
        g["kv_blocks_used"].set(s.blocks_used)
        g["kv_blocks_free"].set(s.blocks_free)
        g["prefill_tokens_queued"].set(s.prefill_tokens_queued)
        self._ray.prompt_tokens.set(s.prompt_tokens_computed)
        self._ray.hit_tokens.set(s.prefix_hit_tokens)
        self._ray.join_waits.set(join_waits)
        self._ray.join_wait_s.set(join_wait_s)
        pool = HOST_BUFFERS.stats()
        self._ray.host_buffers.set(pool.in_use_bytes, tags={"state": "in_use"})
        self._ray.host_buffers.set(pool.free_bytes, tags={"state": "free"})
