"""``pdserve serve``: start (or join) a Ray cluster, deploy the app, print the endpoints, and
stop cleanly on Ctrl-C / SIGTERM (only what this process started is stopped)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from services.affinity import format_cpus, split_cores
from services.config import ServeConfig


def with_local_core_split(cfg: ServeConfig) -> ServeConfig:
    """A one-host cluster with both pools and no pinning given: split this host's cores
    between them (services.affinity), so prefill chunks never stall the decode pool."""
    if cfg.mode == "colocated" or cfg.prefill.cpus is not None or cfg.decode.cpus is not None:
        return cfg
    p, d = cfg.prefill, cfg.decode
    pre, dec = split_cores(
        sorted(os.sched_getaffinity(0)), p.threads * p.replicas, d.threads * d.replicas
    )
    return cfg.model_copy(
        update={
            "prefill": p.model_copy(update={"cpus": format_cpus(pre)}),
            "decode": d.model_copy(update={"cpus": format_cpus(dec)}),
        }
    )


def serve_forever(cfg: ServeConfig, ready: threading.Event | None = None) -> int:
    import ray
    from ray import serve

    from services.app import build_app

    started_ray = False
    if not cfg.ray_address:
        cfg = with_local_core_split(cfg)
    if cfg.ray_address:
        ray.init(address=cfg.ray_address)
    else:
        # NOTE: a local cluster advertises each pool's custom resource, one unit per replica,
        # so prefill and decode replicas land on "their" pool just as on a real cluster.
        pools = [cfg.decode] if cfg.mode == "colocated" else [cfg.prefill, cfg.decode]
        resources: dict[str, float] = {}
        for pool in pools:
            resources[pool.resource] = resources.get(pool.resource, 0) + pool.replicas
        ray.init(resources=resources, include_dashboard=False)
        started_ray = True
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
        serve.run(build_app(cfg), name="pdserve", route_prefix="/")
        base = f"http://{cfg.http_host}:{cfg.http_port}"
        print(
            f"pdserve is serving {cfg.model or 'SmolLM2-135M-Instruct'} ({cfg.mode}; "
            f"{cfg.prefill.replicas if cfg.mode != 'colocated' else 0} prefill, "
            f"{cfg.decode.replicas} decode replicas"
            + (
                f"; cores: prefill {cfg.prefill.cpus}, decode {cfg.decode.cpus}"
                if cfg.decode.cpus
                else ""
            )
            + ")\n"
            f"  OpenAI API: {base}/v1  (completions, chat/completions, models)\n"
            f"  health:     {base}/health\n  metrics:    {base}/metrics\n"
            + (
                f"  gRPC API:   {cfg.http_host}:{cfg.grpc_port}  (pdserve.v1.Generation)\n"
                if cfg.grpc_port
                else ""
            )
            + "Ctrl-C stops it.",
            flush=True,
        )
        if ready is not None:
            ready.set()
        stop.wait()
        print("pdserve: stopping", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
    return 0
