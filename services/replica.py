"""What every engine replica (prefill, decode, colocated) shares: the engine on its loop
thread, the prefix-index publisher, and the stats that operators and the request router read.

Invariant: a replica's index id is the one the request router derives from Ray Serve's
``ReplicaID`` (``services.router.index_id``), so the router can match index hits to replicas
without asking anyone; Serve never reuses a replica id, so a restarted replica starts clean.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from kvtransfer.base import Transport
from services import data_plane
from services.affinity import parse_cpus, pin_current_process
from services.config import PoolConfig, ServeConfig
from services.engine.async_engine import AsyncEngine
from services.engine.engine import Engine, EngineStats
from services.engine.host_buffers import HOST_BUFFERS
from services.prefix_index import PrefixIndex
from services.prefix_index.publisher import IndexPublisher, unique_replica_id
from services.replica_metrics import ReplicaMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    identity: str  # host:pid
    index_id: str  # this replica's id in the prefix index
    stats: EngineStats
    resources: dict[str, float]  # what Ray assigned to this worker (its pool placement)
    cpus: tuple[int, ...] = ()  # the cores this process may run on (its pool's, when pinned)


def assigned_resources() -> dict[str, float]:
    try:
        import ray

        if ray.is_initialized():
            return dict(ray.get_runtime_context().get_assigned_resources())
    except ImportError:
        pass
    return {}


def replica_identity() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


def kv_transport(cfg: ServeConfig) -> Transport:
    """The configured KV transport, with mutual TLS when ``kv_tls_*`` are set (the files are
    read here, in the replica: the config carries paths, not keys)."""
    from pathlib import Path

    from kvtransfer.base import KVTls
    from kvtransfer.transport import get_transport

    tls = None
    if cfg.kv_tls_cert and cfg.kv_tls_key and cfg.kv_tls_ca:
        tls = KVTls(
            Path(cfg.kv_tls_cert).read_bytes(),
            Path(cfg.kv_tls_key).read_bytes(),
            Path(cfg.kv_tls_ca).read_bytes(),
            cfg.kv_tls_server_name,
        )
    return get_transport(cfg.kv_transport, tls)


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def serve_replica_id() -> Any:
    """Ray Serve's ReplicaID of this process, or None outside a Serve replica."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id
    except Exception:  # not in a replica (tests, single process)
        return None


STALL_S = 60.0


class EngineReplica:
    """Args: index: where this replica publishes its prefix cache (None: it does not)."""

    def __init__(
        self,
        cfg: ServeConfig,
        pool: PoolConfig,
        role: Literal["both", "prefill", "decode"],
        index: PrefixIndex | None = None,
    ) -> None:
        from services.router import index_id

        self.cfg = cfg
        a = pool.autoscaling
        self.metrics = (
            ReplicaMetrics(a.window_s, a.percentile, a.busy_window_s)
            if a is not None
            else ReplicaMetrics(30.0)
        )
        HOST_BUFFERS.configure(cfg.kv_host_buffer_mb << 20)
        engine_cfg = cfg.engine_config(pool, role)
        if pool.cpus is not None:
            threads = pin_current_process(parse_cpus(pool.cpus), pool.threads)
            engine_cfg = dataclasses.replace(engine_cfg, threads=threads)
        engine = Engine.from_path(cfg.model, engine_cfg)
        self.profile = {**engine.profile(), "pool": role if role != "both" else "decode"}
        self.engine = AsyncEngine(engine, stall_timeout_s=cfg.request_timeout_s)
        rid = serve_replica_id()
        self.index_id = index_id(rid) if rid is not None else unique_replica_id(role)
        self.publisher: IndexPublisher | None = None
        if index is not None:
            pub = IndexPublisher(
                index,
                self.index_id,
                lambda: self.engine.call(lambda e: e.blocks.cached_hashes()),
                ttl_s=cfg.index_lease_ttl_s,
            )
            # NOTE: set before any request runs; the hooks only append to a deque
            self.engine.call(lambda e: e.blocks.set_listeners(pub.on_cached, pub.on_evicted))
            self.publisher = pub

    def check_health(self) -> None:
        """Called by Ray Serve every few seconds: raising takes this replica out of rotation
        and replaces it. Healthy = the engine loop runs and, with requests open, finished a
        step within STALL_S (the longest step, a full prefill chunk on CPU, takes seconds)."""
        self.engine.check_alive(STALL_S)

    def stats(self) -> EngineStats:
        return self.engine.call(Engine.stats)

    def replica_stats(self) -> ReplicaInfo:
        """Identity, index id, engine stats and Ray-assigned resources of this replica."""
        return ReplicaInfo(
            replica_identity(),
            self.index_id,
            self.stats(),
            assigned_resources(),
            tuple(sorted(os.sched_getaffinity(0))),
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray Serve for the request router (``services.router``); never waits for
        the engine lock (the snapshot is at most one step old). ``doctor``: what this engine
        is and what its steps cost, for the gateway's ``/pdserve/doctor``."""
        s = self.engine.last_stats
        self.metrics.set_gauges(s, self.engine.join_waits, self.engine.join_wait_s)
        return {
            "num_running": s.num_running + s.num_waiting,  # the router's load
            "running": s.num_running,  # the gateway's vllm:num_requests_running
            "waiting": s.num_waiting,
            "blocks_free": s.blocks_free,
            "blocks_total": s.blocks_total,
            "doctor": {
                "identity": self.index_id,
                "profile": self.profile,
                "stats": dataclasses.asdict(s),
                "steps": self.engine.engine.step_log.snapshot(),
            },
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Ray Serve for the SLO autoscaling policy (``services.autoscale.policy``)
        when the pool autoscales; never waits for the engine lock."""
        return self.metrics.autoscaling_stats(self.engine.last_stats, self.engine.busy_s)

    def kv_self_test(self) -> dict[str, float | str] | None:
        """Which transport carries this replica's KV and its start-up self-test bandwidth."""
        r = self.metrics.self_test
        return None if r is None else {"transport": r.transport, "gbps": r.gbps, "bytes": r.nbytes}

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block (operators, tests); the index follows."""
        return self.engine.call(lambda e: e.blocks.reset_prefix_cache())

    def flush_index(self, timeout_s: float = 5.0) -> bool:
        """Wait until this replica's cache events are in the index (tests, operators)."""
        return self.publisher.flush(timeout_s) if self.publisher is not None else True

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.stop()
        self.engine.stop()


def open_index(cfg: ServeConfig, handle: Any = None) -> PrefixIndex | None:
    """The cluster's prefix index as this process should reach it: Redis when a URL is set,
    else the application's ``prefix_index`` deployment through ``handle``. None: no index
    (``routing: least_loaded`` needs none)."""
    if cfg.routing == "least_loaded":
        return None
    if cfg.redis_url:
        from services.prefix_index.redis_index import RedisIndex

        rid = serve_replica_id()
        app = rid.deployment_id.app_name if rid is not None else "default"
        password = cfg.redis_password.get_secret_value() if cfg.redis_password else None
        return RedisIndex(
            cfg.redis_url,
            f"{cfg.index_namespace}:{app}",
            password=password,
            ca_cert=cfg.redis_ca_cert,
        )
    if handle is not None:
        from services.prefix_index.server import HandleIndex

        return HandleIndex(data_plane.on(handle, cfg.serve_data_plane))
    return None
