"""Builders: the only place Ray Serve deployments are made from the plain classes.

``build_app(cfg)`` returns the bound application; ``app_from_env(args)`` is the import path
for ``serve run`` / ``serve deploy`` config files (see deploy/serve_config.yaml).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from services.config import PoolConfig, ServeConfig, load_config, secrets_from, secrets_in_env
from services.decode.server import DecodeServer
from services.gateway.gateway import Gateway
from services.gateway.http_api import build_http_app
from services.prefill.server import PrefillServer
from services.prefix_index.server import IndexServer
from services.router import PdRequestRouter


def _shutdown_options(cfg: ServeConfig) -> dict[str, Any]:
    """Replicas wait for their in-flight requests at most the grace period, checking often:
    an idle replica stops at once (Ray's defaults, 20 s and 2 s, made an idle cluster take
    over 30 s to exit)."""
    return {
        "graceful_shutdown_timeout_s": cfg.shutdown_grace_s,
        "graceful_shutdown_wait_loop_s": 0.2,
    }


def _actor_options(pool: PoolConfig) -> dict[str, Any]:
    # NOTE: one torch/OMP thread per replica by default; placement by the pool's custom
    # resource (node resources in a real cluster, ray.init(resources=...) locally) plus GPUs.
    threads = str(pool.threads)
    return {
        "num_cpus": 0,
        "num_gpus": pool.num_gpus,
        "resources": {pool.resource: 1},
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}},
    }


def _replicas(pool: PoolConfig, metric: str) -> dict[str, Any]:
    """``num_replicas``, or an SLO autoscaling config (services.autoscale.policy)."""
    a = pool.autoscaling
    if a is None:
        return {"num_replicas": pool.replicas}
    return {
        "autoscaling_config": {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": min(a.max_replicas, max(a.min_replicas, pool.replicas)),
            "metrics_interval_s": a.metrics_interval_s,
            "look_back_period_s": a.look_back_s,
            # NOTE: the worst report in the look-back window: scale-downs wait for it to pass
            "aggregation_function": "max",
            # NOTE: Ray wraps custom policies in its own delays (30 s up, 600 s down by
            # default); the planner owns delays and cool-downs, so Ray's are off
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0,
            "policy": {
                "policy_function": "services.autoscale.policy:SloPolicy",
                "policy_kwargs": asdict(a.target(metric)),
            },
        }
    }


class _GatewayIngress(Gateway):
    """``secrets_from_env``: the API keys are not in the bound ``cfg`` (Ray keeps bound
    arguments in its state); this process reads them from the environment it inherits."""

    def __init__(
        self,
        prefill: Any,
        decode: Any,
        cfg: ServeConfig,
        index_handle: Any = None,
        secrets_from_env: bool = False,
    ) -> None:
        if secrets_from_env:
            cfg = cfg.model_copy(update=secrets_from(os.environ))
        super().__init__(prefill, decode, cfg, index_handle)

    def __serve_build_asgi_app__(self):  # type: ignore[no-untyped-def]
        return build_http_app(self)


def build_app(cfg: ServeConfig):  # -> serve Application
    # the in-process prefix index lives in its own small deployment (see prefix_index.server)
    index = None
    if cfg.routing == "prefix_aware" and not cfg.redis_url:
        index = serve.deployment(
            IndexServer, name="prefix_index", num_replicas=1, ray_actor_options={"num_cpus": 0}
        ).bind()

    def router(pool: str) -> RequestRouterConfig:
        return RequestRouterConfig(
            request_router_class=PdRequestRouter,
            request_router_kwargs={"pool": pool},
            request_routing_stats_period_s=cfg.routing_stats_period_s,
        )

    # NOTE: engine replicas never check the API token: their config (pickled into Ray's state
    # with each replica's arguments) does not carry it; only the gateway's does
    engine_cfg = cfg.model_copy(update={"auth_token": None, "api_keys": {}})
    decode_role = "both" if cfg.mode == "colocated" else "decode"
    decode = serve.deployment(
        DecodeServer,
        name="decode",
        **_replicas(cfg.decode, "itl"),
        ray_actor_options=_actor_options(cfg.decode),
        max_ongoing_requests=cfg.decode.max_num_seqs,
        max_queued_requests=cfg.decode.max_queued_requests,
        request_router_config=router("decode"),
        **_shutdown_options(cfg),
    ).bind(engine_cfg, decode_role, index)
    if cfg.mode == "colocated":
        prefill = None
    else:
        prefill = serve.deployment(
            PrefillServer,
            name="prefill",
            **_replicas(cfg.prefill, "ttft"),
            ray_actor_options=_actor_options(cfg.prefill),
            max_ongoing_requests=cfg.prefill.max_num_seqs,
            max_queued_requests=cfg.prefill.max_queued_requests,
            request_router_config=router("prefill"),
            **_shutdown_options(cfg),
        ).bind(engine_cfg, index)
    gateway_options: dict[str, Any] = {"num_cpus": 0}
    if cfg.gateway_resource:
        gateway_options["resources"] = {cfg.gateway_resource: 1}
    gateway = serve.deployment(
        serve.ingress()(_GatewayIngress),
        name="gateway",
        ray_actor_options=gateway_options,
        # NOTE: the gateway's own admission (max_inflight_requests) refuses overload with a
        # retry hint; Ray's limit sits above it so /health and /metrics still get through
        max_ongoing_requests=cfg.max_inflight_requests + 64,
        **_shutdown_options(cfg),
    )
    # NOTE: the API keys stay out of Ray's state when the gateway's process can read them from
    # the environment it inherits (the chart's head pod, a local `pdserve serve`)
    from_env = secrets_in_env(cfg, os.environ) and (cfg.auth_token or cfg.api_keys)
    gw_cfg = cfg.model_copy(update={"auth_token": None, "api_keys": {}}) if from_env else cfg
    return gateway.bind(prefill, decode, gw_cfg, index, bool(from_env))


def app_from_env(args: dict[str, Any]):  # -> serve Application
    """Entry point for Ray Serve config files: ``args`` may name ``config`` (a YAML path) and
    any ServeConfig field."""
    return build_app(config_from_args(args))


def config_from_args(args: dict[str, Any] | None) -> ServeConfig:
    """The ``args`` of a Serve config file (deploy/serve_config.yaml, the Helm chart's
    RayService) -> the validated configuration, as ``app_from_env`` reads them."""
    args = dict(args or {})
    path = args.pop("config", None) or os.environ.get("PDSERVE_CONFIG")
    return load_config(path, args)
