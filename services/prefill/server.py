"""Prefill replica (a plain class; the Ray Serve deployment is made in ``services.app``).

Request lifecycle on a prefill replica:
1. ``prefill(spec)`` runs the prompt (prefix-cache reuse, chunked) as a prefill-only request.
2. The first token is sampled; the request's KV blocks are HELD by the engine.
3. The reply names this replica's KV transfer address; a decode replica pulls the blocks and
   releases them, or the engine frees them after ``kv_hold_timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.source import EngineKVSource
from kvtransfer.transport import get_transport
from services.config import ServeConfig
from services.engine.async_engine import AsyncEngine
from services.engine.engine import Engine, EngineStats
from services.engine.request import FinishReason, RequestOutput
from services.pd_flow import GenerateSpec, PrefillResult


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    identity: str  # host:pid
    stats: EngineStats
    resources: dict[str, float]  # what Ray assigned to this worker (its pool placement)


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


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class PrefillServer:
    def __init__(self, cfg: ServeConfig) -> None:
        engine = Engine.from_path(cfg.model, cfg.engine_config(cfg.prefill, "prefill"))
        self.engine = AsyncEngine(engine, stall_timeout_s=cfg.request_timeout_s)
        self.kv_server = get_transport(cfg.kv_transport).serve(
            EngineKVSource(engine, self.engine.lock), node_ip(), 0
        )

    async def prefill(self, spec: GenerateSpec) -> PrefillResult:
        out: RequestOutput | None = None
        async for o in self.engine.generate(
            spec.request_id, spec.prompt_ids, spec.params, prefill_only=True
        ):
            out = o
        assert out is not None and out.finished
        held = out.finish_reason is FinishReason.PREFILLED
        return PrefillResult(
            request_id=spec.request_id,
            first_token=out.new_token_ids[0],
            first_text=out.new_text,
            first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
            finish_reason=None if held else str(out.finish_reason),
            kv_address=self.kv_server.address if held else None,
            queue_s=out.queue_s or 0.0,
            prefill_s=out.prefill_s or 0.0,
        )

    def stats(self) -> EngineStats:
        return self.engine.call(Engine.stats)

    def replica_stats(self) -> ReplicaInfo:
        """Identity, engine stats and Ray-assigned resources of this replica."""
        return ReplicaInfo(replica_identity(), self.stats(), assigned_resources())

    def __del__(self) -> None:
        # NOTE: replicas are torn down by Ray; stop the transport server and the loop thread
        self.kv_server.stop(0)
        self.engine.stop()
