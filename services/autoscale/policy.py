"""The SLO planner as a Ray Serve custom autoscaling policy.

Ray Serve's controller instantiates ``SloPolicy(**policy_kwargs)`` once per deployment and
calls it every control-loop tick with an ``AutoscalingContext``. Replicas report
``ttft_p``/``ttft_n``/``itl_p``/``itl_n`` (latency percentile of their recent window and its
sample count), ``busy`` (compute utilisation) and ``queued_tokens``/``requests``/``kv_usage`` through
``record_autoscaling_stats`` (see ``services.replica_metrics``); the controller aggregates each
over ``look_back_period_s``. Planner state (last change, last busy time) lives in the policy
state Ray keeps between calls.

Imported by the controller: keep this module free of torch and engine imports.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from services.autoscale.planner import PlannerState, PoolTarget, Signals, decide

log = logging.getLogger("ray.serve")


def pool_signals(
    metric: str, metrics: dict[str, dict[Any, float]], now: float, running: int, target: int
) -> Signals:
    """Replica reports -> one pool's signals: the sample-weighted latency percentile across
    replicas (a replica with no samples carries no weight), summed queues, the busiest KV,
    the mean utilisation."""
    p, n = metrics.get(f"{metric}_p", {}), metrics.get(f"{metric}_n", {})
    weight = sum(w for w in n.values() if w > 0)
    latency = sum(p.get(r, 0.0) * w for r, w in n.items() if w > 0) / weight if weight > 0 else None
    busy = list(metrics.get("busy", {}).values())
    return Signals(
        now=now,
        running_replicas=running,
        target_replicas=target,
        latency_s=latency,
        queued_tokens=sum(metrics.get("queued_tokens", {}).values()),
        kv_usage=max(metrics.get("kv_usage", {}).values(), default=0.0),
        requests=sum(metrics.get("requests", {}).values()),
        busy=sum(busy) / len(busy) if busy else None,
    )


class SloPolicy:
    """``policy_kwargs`` are ``PoolTarget`` fields."""

    def __init__(self, **target: Any) -> None:
        self.target = PoolTarget(**target)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time if ctx.current_time is not None else time.time()
        sig = pool_signals(
            self.target.metric,
            ctx.aggregated_metrics or {},
            now,
            ctx.current_num_replicas,
            ctx.target_num_replicas,
        )
        state = PlannerState(**ctx.policy_state.get("planner", {}))
        d = decide(self.target, sig, state)
        if d.replicas != ctx.target_num_replicas:
            log.info(
                "pdserve autoscaler: %s %d -> %d (%s; %s p%.0f %s, target %.3fs)",
                ctx.deployment_name,
                ctx.target_num_replicas,
                d.replicas,
                d.reason,
                self.target.metric,
                100 * self.target.percentile,
                "n/a" if sig.latency_s is None else f"{sig.latency_s:.3f}s",
                self.target.target_s,
            )
        return d.replicas, {"planner": asdict(d.state), "reason": d.reason, "pressure": d.pressure}
