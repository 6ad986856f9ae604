"""How Ray Serve carries the calls between pdserve's deployments (``ServeConfig.serve_data_plane``).

``grpc``: a deployment handle calls its replicas straight over gRPC (every Serve replica runs
that server; Ray attaches its token interceptor to it) instead of as a Ray actor call. Each
request's prefill and decode calls and every streamed token take this path, so it sets the
gateway's CPU per token. Two places decide it:
- a handle's own option (``_by_reference``), fixed where the handle is made: pdserve's handles
  come from the driver that builds the app, so the gateway sets it on its handles (``on``);
- Serve's HTTP proxy reads ``RAY_SERVE_USE_GRPC_BY_DEFAULT`` when it starts (``ENV``): the
  launcher hands it to the actors it starts, the Helm chart puts it on every Ray pod.
(Serve's other throughput switch, the router in the caller's own event loop, stays off: a
handle used from a thread, as the prefix index's publisher does, would find no loop there.)
"""

from __future__ import annotations

from typing import Any

ENV = {
    "grpc": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    "actor": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"},
}


def on(handle: Any, plane: str) -> Any:
    """``handle`` calling over ``plane`` (a Serve ``DeploymentHandle``, or a test's fake with
    the same ``options`` surface); None stays None (a deployment the app does not have, as
    the prefill pool in colocated mode)."""
    return None if handle is None else handle.options(_by_reference=plane != "grpc")
