"""Readiness of a gateway replica: should a load balancer send it traffic?

Liveness (``/health``) only says the gateway process answers. Readiness (``/ready``, and the
gRPC health service's status) also says the cluster behind it can serve: the gateway is not
draining for shutdown, and every pool it routes to (prefill, decode) has at least one running
replica: a replica that finished loading its model and passes its health check
(``EngineReplica.check_health``). Until then ``/ready`` answers 503 with the reason, so a
freshly started cluster takes no traffic while its models load, and a draining one sheds
new traffic while in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence


def serve_pool_replicas() -> dict[str, int]:
    """Running replicas per deployment of this replica's Ray Serve application."""
    from ray import serve

    app = serve.get_replica_context().app_name
    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {name: int(d.replica_states.get("RUNNING", 0)) for name, d in status.deployments.items()}


class Readiness:
    """Args: pools: the deployments that must each have a running replica; replicas: counts
    them (``serve_pool_replicas`` in a cluster; injected in tests); ttl_s: how long one
    answer is reused (probes come every few seconds from every load balancer)."""

    def __init__(
        self,
        pools: Sequence[str],
        replicas: Callable[[], dict[str, int]] = serve_pool_replicas,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pools = tuple(pools)
        self.draining = False
        self._replicas = replicas
        self._ttl_s = ttl_s
        self._clock = clock
        self._cached: tuple[float, bool, str] | None = None

    def drain(self) -> None:
        """From now on: not ready, and new requests are refused (503) while in-flight ones
        finish."""
        self.draining = True

    async def check(self) -> tuple[bool, str]:
        """(ready, the reason when not)."""
        if self.draining:
            return False, "draining: the server is shutting down"
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self._ttl_s:
            return self._cached[1], self._cached[2]
        try:
            counts = await asyncio.to_thread(self._replicas)
            missing = [p for p in self.pools if counts.get(p, 0) < 1]
            ready = not missing
            why = "" if ready else f"no running replica yet in: {', '.join(missing)}"
        except Exception as e:  # the controller is unreachable: not ready, and say why
            ready, why = False, f"cannot read the cluster's status: {e}"
        self._cached = (now, ready, why)
        return ready, why
