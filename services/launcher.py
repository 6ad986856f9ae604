"""``pdserve serve``: start (or join) a Ray cluster, deploy the app, print the endpoints, and
stop cleanly on Ctrl-C / SIGTERM (only what this process started is stopped).

Shutdown: a signal while the app still starts interrupts the start-up; a signal while it
serves drains first: the gateway stops admitting (``/ready`` fails, new requests get 503) and
in-flight requests get up to ``shutdown_grace_s`` to finish, then everything stops. Replicas
are deployed with a short graceful-shutdown wait, so an idle cluster exits in seconds, inside
Kubernetes' default 30 s grace period.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
from collections.abc import MutableMapping

from services import data_plane
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


def for_one_host(cfg: ServeConfig) -> ServeConfig:
    """What a one-host cluster (no ``ray_address``: the launcher starts Ray) changes: the core
    split, and KV servers on loopback unless an address was given (the KV plane needs no
    network there, so it is not exposed to one)."""
    cfg = with_local_core_split(cfg)
    if cfg.kv_host == "auto":
        cfg = cfg.model_copy(update={"kv_host": "127.0.0.1"})
    return cfg


def ray_runtime_env(cfg: ServeConfig) -> dict[str, dict[str, str]]:
    """The job's runtime environment: every actor this driver starts (Serve's controller, and
    through it the proxies and replicas) gets ``serve_data_plane``'s variable
    (``services.data_plane``). NOTE: not this process's own environment."""
    return {"env_vars": dict(data_plane.ENV[cfg.serve_data_plane])}


def local_ray_auth(environ: MutableMapping[str, str]) -> None:
    """Ray's token authentication for the one-host cluster the launcher starts: its GCS and
    raylet listen on every interface, and without a token any process that reaches them may
    run code. A fresh random token per start (the launcher's Ray processes inherit it), unless
    the operator set RAY_AUTH_MODE / RAY_AUTH_TOKEN. NOTE: Ray reads the mode when it is
    imported: call this before anything imports ray (``pdserve serve`` does)."""
    if environ.get("RAY_AUTH_MODE", "token") == "token":
        environ["RAY_AUTH_MODE"] = "token"
        environ.setdefault("RAY_AUTH_TOKEN", secrets.token_urlsafe(32))


def serve_forever(cfg: ServeConfig, ready: threading.Event | None = None) -> int:
    import ray
    from ray import serve

    from services.app import build_app

    started_ray = False
    if not cfg.ray_address:
        cfg = for_one_host(cfg)
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, runtime_env=ray_runtime_env(cfg))
    else:
        # NOTE: a local cluster advertises each pool's custom resource, one unit per replica,
        # so prefill and decode replicas land on "their" pool just as on a real cluster.
        pools = [cfg.decode] if cfg.mode == "colocated" else [cfg.prefill, cfg.decode]
        resources: dict[str, float] = {}
        for pool in pools:
            resources[pool.resource] = resources.get(pool.resource, 0) + pool.replicas
        ray.init(resources=resources, include_dashboard=False, runtime_env=ray_runtime_env(cfg))
        started_ray = True
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(*_: object) -> None:
        if serving.is_set():
            stop.set()  # drained below, on the main thread
        else:
            raise Interrupted  # out of serve.run: still starting, nothing to drain

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
        serve.run(build_app(cfg), name=APP, route_prefix="/")
        serving.set()
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
        print("pdserve: draining", file=sys.stderr, flush=True)
        drain(cfg.shutdown_grace_s)
        print("pdserve: stopping", file=sys.stderr, flush=True)
    except Interrupted:
        print("pdserve: interrupted while starting; stopping", file=sys.stderr, flush=True)
        # NOTE: the gateway may admit requests before serve.run returns (it answers /ready as
        # soon as every pool has a replica; serve.run waits for the controller's next status
        # round): drain what it admitted, asking briefly, since it may not be up at all
        drain(cfg.shutdown_grace_s, first_call_s=2)
    finally:
        if not (started_ray and not serving.is_set()):
            # NOTE: Serve's shutdown waits for each replica's graceful stop, which queues
            # behind a replica's constructor (a model still loading); a cluster this process
            # started that never served has nothing to drain or hand over: stopping Ray
            # ends every replica at once
            serve.shutdown()
        if started_ray:
            ray.shutdown()
    return 0


APP = "pdserve"


class Interrupted(BaseException):
    """A stop signal arrived while the app was still starting."""


def drain(grace_s: float, first_call_s: float = 10) -> int:
    """Stop admitting at the gateway, then wait up to ``grace_s`` for its in-flight requests;
    returns how many were still running when the wait ended. ``first_call_s``: how long the
    gateway has to answer the first call (it may still be starting)."""
    import time

    from ray import serve

    gateway = serve.get_deployment_handle("gateway", app_name=APP)
    try:
        gateway.drain.remote().result(timeout_s=first_call_s)
        deadline = time.monotonic() + grace_s
        while (left := gateway.inflight.remote().result(timeout_s=10)) > 0:
            if time.monotonic() >= deadline:
                print(f"pdserve: {left} requests still running at the grace deadline",
                      file=sys.stderr, flush=True)  # fmt: skip
                return left
            time.sleep(0.2)  # polling the gateway while the requests finish
    except Exception as e:  # the gateway is gone already: nothing left to drain
        print(f"pdserve: drain skipped ({e})", file=sys.stderr, flush=True)
    return 0
