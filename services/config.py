"""The cluster's configuration: one validated model (pydantic at the edge), from a YAML file,
``PDSERVE_*`` environment variables and CLI flags, in that order of precedence (flags win).

Environment variables: ``PDSERVE_<FIELD>`` for top-level fields and ``PDSERVE_<POOL>__<FIELD>``
for pool fields, e.g. ``PDSERVE_MODE=colocated``, ``PDSERVE_DECODE__REPLICAS=2``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from services.affinity import parse_cpus
from services.autoscale.planner import PoolTarget
from services.engine.config import EngineConfig


class PoolAutoscaling(BaseModel):
    """SLO autoscaling of one pool (see ``services.autoscale.planner`` for the rule): the
    prefill pool is sized by TTFT, the decode pool (or the colocated one) by ITL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_s: float = Field(
        gt=0, description="latency target, seconds: TTFT (prefill pool) or ITL (decode pool)"
    )
    percentile: float = Field(0.9, gt=0, lt=1, description="the percentile held to the target")
    min_replicas: int = Field(1, ge=1, le=256)
    max_replicas: int = Field(4, ge=1, le=256)
    up_ratio: float = Field(1.0, gt=0, description="scale up above target x this")
    down_ratio: float = Field(0.6, gt=0, description="scale down only below target x this")
    max_step: int = Field(1, ge=1, description="most replicas added or removed per decision")
    up_cooldown_s: float = Field(30.0, ge=0, description="after a scale-up, wait before another")
    down_cooldown_s: float = Field(120.0, ge=0, description="after any change, wait to scale down")
    up_delay_s: float = Field(5.0, ge=0, description="a miss must last this long to scale up")
    down_delay_s: float = Field(60.0, ge=0, description="room must last this long to scale down")
    idle_s: float = Field(60.0, ge=0, description="no traffic this long: shrink toward the min")
    queued_tokens_per_replica: float = Field(
        0.0,
        ge=0,
        description="prefill: queued prompt tokens per replica that count as a miss; 0 = off",
    )
    kv_usage_high: float = Field(
        0.9, ge=0, le=1, description="decode: KV usage that counts as a miss; 0 = off"
    )
    max_busy: float = Field(
        0.7, gt=0, le=1, description="a scale-down may not push compute utilisation above this"
    )
    window_s: float = Field(30.0, gt=0, description="replicas' latency window")
    busy_window_s: float = Field(60.0, gt=0, description="replicas' utilisation window")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often replicas report")
    look_back_s: float = Field(5.0, gt=0, description="the controller's window over reports")

    @model_validator(mode="after")
    def _planner_accepts(self) -> PoolAutoscaling:
        self.target("ttft")  # PoolTarget checks bounds and the hysteresis band
        return self

    def target(self, metric: Literal["ttft", "itl"]) -> PoolTarget:
        return PoolTarget(
            metric=metric,
            **self.model_dump(
                exclude={"window_s", "busy_window_s", "metrics_interval_s", "look_back_s"}
            ),
        )


class PoolConfig(BaseModel):
    """One worker pool (prefill or decode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(1, ge=1, le=256, description="replicas in this pool")
    resource: str = Field(description="Ray custom resource that marks this pool's nodes")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (0 on CPU)")
    threads: int = Field(1, ge=1, le=256, description="torch threads per replica")
    cpus: str | None = Field(
        None,
        description="CPU list this pool's replicas are pinned to (e.g. '0-3,8'); None = no "
        "pinning, except that a local one-host cluster splits its cores between the pools",
    )
    num_kv_blocks: int = Field(1024, ge=16, description="KV blocks per replica")
    max_num_seqs: int = Field(64, ge=1, description="running requests per replica")
    max_num_batched_tokens: int = Field(1024, ge=16, description="per-step token budget")
    max_queued_requests: int = Field(
        -1,
        ge=-1,
        description="requests that may wait for this pool's replicas beyond max_num_seqs each; "
        "more are refused as overload (HTTP 429 / RESOURCE_EXHAUSTED); -1 = unbounded",
    )
    autoscaling: PoolAutoscaling | None = Field(
        None, description="SLO autoscaling of this pool; None = a fixed ``replicas`` count"
    )

    @model_validator(mode="after")
    def _cpus(self) -> PoolConfig:
        if self.cpus is not None:
            parse_cpus(self.cpus)  # raises ValueError naming the bad part
        return self


class ServeConfig(BaseModel):
    """Everything ``pdserve serve`` deploys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="GGUF file or HF folder; None = embedded SmolLM2")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="separate prefill and decode pools, or one pool for both"
    )
    conditional_threshold: int = Field(
        0,
        ge=0,
        description="disaggregated mode: prompts shorter than this many (uncached) tokens are "
        "prefilled on the decode replica itself; 0 disables",
    )
    batch_invariant: bool | Literal["auto"] = Field(
        "auto",
        description="each linear's kernel chosen by the row's role (prompt rows: packed GEMMs; "
        "generated rows: the decode kernels) instead of by the step's size, so a seeded "
        "request's tokens do not depend on the requests it is batched with (a resumed "
        "request's replay then matches under any load). auto: on with the cpu attention "
        "backend (the CPU default) when matmuls run in fp32, off where they run in bf16 on "
        "AMX (it would cost 2.9x decode throughput there); true elsewhere is refused. Costs decode speed above 16 "
        "rows a step; prefix-cache hits can still change the rounding",
    )
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block")
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="longest prompt + output, tokens; None = the model's, capped by each "
        "pool's KV capacity (a longer explicit value is refused at start)",
    )
    served_model_name: str | None = Field(
        None, description="the model id the APIs answer to and report; None = the model's"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto = bfloat16 on GPUs; on CPUs float32 activations and KV, with bf16 "
        "matrix products where the CPU has native bf16 (AMX / AVX512-BF16)",
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weights: auto keeps a GGUF's Q8_0/Q4_x weights quantized (CPU kernels); "
        "none = dtype everywhere; int8/int4 quantize float weights on load (CPU)",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto",
        description="KV cache storage: auto = the matrix products' dtype (bf16 on a CPU with "
        "native bf16 under dtype auto, else dtype); float32 / bfloat16 as named; int8 = int8 "
        "with a scale per 32 values (a quarter of fp32's bytes: 4x the blocks in the same memory)",
    )
    device: str = Field("cpu", description="cpu or cuda")
    speculative_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="prompt-lookup speculative decoding: draft tokens per decode step from the "
        "request's own text (lossless; pays off on copy-heavy work); 0 = off",
    )
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="kernels: auto = triton on CUDA, torch (the reference) elsewhere"
    )
    cuda_graphs: bool = Field(
        True, description="CUDA: replay decode steps as CUDA graphs (triton backend)"
    )
    gpu_memory_utilization: float | None = Field(
        0.9,
        gt=0,
        le=1,
        description="CUDA: share of device memory for weights, activations and the KV pool, "
        "which takes what is left (num_kv_blocks is then ignored); null = num_kv_blocks",
    )
    http_host: str = Field("127.0.0.1", description="HTTP bind address")
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP API")
    grpc_port: int = Field(
        50051, ge=0, le=65535, description="public gRPC API (pdserve.v1), on http_host; 0 = off"
    )
    grpc_tls_cert: str | None = Field(
        None, description="PEM certificate chain: serve the gRPC API over TLS (needs the key)"
    )
    grpc_tls_key: str | None = Field(None, description="PEM private key of grpc_tls_cert")
    auth_token: SecretStr | None = Field(
        None,
        description="bearer token the HTTP (/v1/*) and gRPC APIs require (PDSERVE_AUTH_TOKEN); "
        "None = no authentication",
    )
    api_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="tenant name -> bearer key (PDSERVE_API_KEYS as JSON); each tenant's "
        "prefix cache is its own (a per-key salt). auth_token, if set, is tenant 'default'",
    )
    max_inflight_requests: int = Field(
        1000,
        ge=1,
        description="requests one gateway replica serves at once (HTTP and gRPC together); "
        "more are refused as overload (HTTP 429 / RESOURCE_EXHAUSTED)",
    )
    retry_after_s: float = Field(
        1.0, gt=0, description="retry hint sent with an overload refusal (Retry-After)"
    )
    max_request_bytes: int = Field(
        2 << 20,
        ge=1024,
        description="largest request body (HTTP) or message (gRPC) accepted, checked before "
        "it is read or parsed; larger ones get HTTP 413 / RESOURCE_EXHAUSTED",
    )
    kv_transport: Literal["grpc", "shm", "gloo", "nccl"] = Field(
        "grpc",
        description="KV transport: grpc (streamed), shm (shared memory on one host, else "
        "grpc), gloo (torch.distributed on CPU), nccl (torch.distributed between GPUs)",
    )
    kv_streaming: bool = Field(
        True,
        description="send KV layer by layer while the prefill computes, so the decode replica "
        "has it moments after the first token (every transport); false: the decode replica "
        "pulls the whole KV after the prefill",
    )
    kv_host: str = Field(
        "auto",
        min_length=1,
        description="address each prefill replica's KV server binds to and names in its KV "
        "refs: auto = the node's IP as Ray knows it (the pod IP in Kubernetes), and loopback "
        "under a one-host `pdserve serve` that starts its own Ray; or an explicit address. "
        "Every KV call must also carry its transfer's secret",
    )
    kv_tls_cert: str | None = Field(
        None,
        description="mutual TLS for the KV plane (kv_transport grpc or shm): this replica's "
        "PEM certificate, presented as KV server and as KV client",
    )
    kv_tls_key: str | None = Field(None, description="PEM private key of kv_tls_cert")
    kv_tls_ca: str | None = Field(
        None, description="PEM CA certificate every KV peer's certificate must be signed by"
    )
    kv_tls_server_name: str | None = Field(
        None,
        description="the name in the prefill replicas' certificates, checked instead of the "
        "dialled address (pod IPs are unknown when certificates are issued)",
    )
    kv_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of each prefill replica's KV server (fixed, so a NetworkPolicy can "
        "name it); 0 = any free port (needed for several prefill replicas on one node)",
    )
    gateway_resource: str | None = Field(
        None,
        description="Ray custom resource the gateway replica needs (Kubernetes: only the head "
        "advertises it, so the gRPC port is on the head pod); None = any node",
    )
    kv_timeout_s: float = Field(30.0, gt=0, description="deadline of one KV pull")
    kv_host_buffer_mb: int = Field(
        512,
        ge=0,
        description="host memory each replica keeps for reuse by received and exported KV "
        "buffers once they are done with (warm memory instead of fresh pages); 0 = keep none",
    )
    kv_pull_budget_mb: int = Field(
        1024,
        ge=1,
        description="KV a decode replica may be pulling at once (held in host memory until "
        "imported); a pull that would pass it, or need more blocks than the engine has free, "
        "waits for earlier ones (back-pressure)",
    )
    kv_stream_buffer_mb: int = Field(
        512,
        ge=0,
        description="host memory a prefill replica may hold in layer-wise KV pieces not yet "
        "sent; a stream that would pass it stops queueing and sends its KV from the held "
        "blocks once the prefill ends (as a whole pull)",
    )
    kv_stream_stall_s: float = Field(
        30.0,
        ge=10,
        description="a decode replica gives up a layer-wise KV stream that brought nothing for "
        "this long (a prefill replica sends a heartbeat every 2 s while its engine makes "
        "progress, so a queued prefill is not a stalled one)",
    )
    kv_join_wait_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="a decode replica that has every layer of a request's streamed KV waits up "
        "to this long after a step for the request to join before it starts the next step, so "
        "the request's second token comes a step sooner (the running requests wait instead, "
        "once per prefill chunk that finishes prompts); 0 = never wait",
    )
    kv_hold_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a prefill replica keeps a request's KV this long for its decode replica "
        "(the handoff's lease), then frees it",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="longest a request may run")
    special_tokens_in_messages: bool = Field(
        False,
        description="chat message content may contain the model's control tokens (the old, "
        "unsafe behaviour: a user could type `<|im_start|>system` and forge a turn); by "
        "default only the chat template's own markup yields control tokens",
    )
    resume_timeout_s: float = Field(
        30.0,
        ge=0,
        description="after a replica dies mid-request, how long the gateway keeps resuming the "
        "request elsewhere (replay from the same seed, with backoff) before it ends the stream "
        "with an explicit error; 0 = never resume",
    )
    shutdown_grace_s: float = Field(
        20.0,
        ge=0,
        description="on SIGTERM: how long in-flight requests may finish (new ones get 503 and "
        "readiness fails meanwhile) before the cluster stops",
    )
    ray_address: str | None = Field(None, description="join this Ray cluster; None = start one")
    serve_data_plane: Literal["grpc", "actor"] = Field(
        "grpc",
        description="how Ray Serve carries the calls between pdserve's deployments (each "
        "request's prefill and decode calls, every streamed token): grpc = straight between "
        "the replicas over gRPC (the data plane of Ray Serve's throughput-optimized mode; "
        "authenticated like Ray's own calls); actor = Ray actor calls. Ray reads it when its "
        "processes start: `pdserve serve` hands it to the actors it starts, the Helm chart "
        "puts it on its pods; a Serve instance already running keeps its own",
    )
    routing: Literal["prefix_aware", "least_loaded"] = Field(
        "prefix_aware",
        description="prefill replica choice: cached prefix against queued work, or load only",
    )
    redis_url: str | None = Field(
        None,
        description="prefix index in Redis (redis://host:port/db, rediss:// for TLS); "
        "None = the in-process index of the application",
    )
    redis_password: SecretStr | None = Field(
        None, description="Redis password (PDSERVE_REDIS_PASSWORD; overrides one in the URL)"
    )
    redis_ca_cert: str | None = Field(None, description="CA bundle to verify a rediss:// server")
    index_namespace: str = Field(
        "pdserve", min_length=1, description="Redis key prefix (the app name is appended)"
    )
    index_lease_ttl_s: float = Field(
        10.0, gt=0, description="a replica's index entries vanish this long after it dies"
    )
    index_retry_s: float = Field(
        1.0, gt=0, description="after an index error, route by load only for this long"
    )
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="how often replicas report load to the request router"
    )
    prefill: PoolConfig = PoolConfig(resource="prefill_pool")
    decode: PoolConfig = PoolConfig(resource="decode_pool")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _api_keys_json(cls, v: object) -> object:
        """PDSERVE_API_KEYS holds the map as JSON; names and keys must be non-empty, keys
        distinct (one key, one tenant)."""
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"api_keys: not a JSON object of name -> key: {e}") from None
        if isinstance(v, dict):
            keys = [x.get_secret_value() if isinstance(x, SecretStr) else x for x in v.values()]
            if any(not n or not isinstance(n, str) for n in v) or any(not k for k in keys):
                raise ValueError("api_keys: every tenant name and key must be non-empty")
            if len(set(keys)) != len(keys):
                raise ValueError("api_keys: two tenants share a key")
        return v

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the smallest serving pool's KV cache holds (one request can use at most
        that), where the config fixes it: ``num_kv_blocks`` on CPU, or on CUDA without
        ``gpu_memory_utilization``; None where the replica sizes its pool from free memory."""
        if self.device.startswith("cuda") and self.gpu_memory_utilization is not None:
            return None
        pools = [self.decode] if self.mode == "colocated" else [self.prefill, self.decode]
        return min(p.num_kv_blocks for p in pools) * self.block_size

    @model_validator(mode="after")
    def _max_model_len_fits(self) -> ServeConfig:
        cap = self.kv_capacity_tokens()
        if self.max_model_len is not None and cap is not None and self.max_model_len > cap:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit the KV cache: the smallest "
                f"serving pool holds {cap} tokens (num_kv_blocks x block_size {self.block_size}); "
                "lower max_model_len or raise the pools' num_kv_blocks"
            )
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> ServeConfig:
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ValueError("grpc_tls_cert and grpc_tls_key must be given together")
        kv_tls = (self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca)
        if any(x is not None for x in kv_tls) and any(x is None for x in kv_tls):
            raise ValueError("kv_tls_cert, kv_tls_key and kv_tls_ca must be given together")
        if self.kv_tls_cert is not None and self.kv_transport not in ("grpc", "shm"):
            raise ValueError(
                f"kv_tls_* needs kv_transport grpc or shm; {self.kv_transport} has no TLS"
            )
        return self

    def engine_config(
        self, pool: PoolConfig, role: Literal["both", "prefill", "decode"]
    ) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size,
            num_kv_blocks=pool.num_kv_blocks,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            role=role,
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            speculative_tokens=self.speculative_tokens,
            attention_backend=self.attention_backend,
            cuda_graphs=self.cuda_graphs,
            gpu_memory_utilization=self.gpu_memory_utilization,
            threads=pool.threads,
            batch_invariant=self.batch_invariant,
            max_model_len=self.max_model_len,
        )


SECRET_FIELDS = ("auth_token", "api_keys")


def secrets_from(environ: Mapping[str, str]) -> dict[str, Any]:
    """The API keys the environment holds, validated as the loader does."""
    env = {k: v for k, v in _env_overrides(environ).items() if k in SECRET_FIELDS}
    cfg = ServeConfig.model_validate(env)
    return {k: getattr(cfg, k) for k in SECRET_FIELDS}


def secrets_in_env(cfg: ServeConfig, environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` alone gives ``cfg``'s API keys (so a process that inherits it reads
    them there, and they need not be pickled into Ray's state with its arguments)."""

    def plain(x: Any) -> Any:
        if isinstance(x, SecretStr):
            return x.get_secret_value()
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    try:
        env = secrets_from(environ)
    except ValueError:
        return False
    return all(plain(env[k]) == plain(getattr(cfg, k)) for k in SECRET_FIELDS)


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fields = ServeConfig.model_fields
    for key, value in environ.items():
        if not key.startswith("PDSERVE_"):
            continue
        name = key[len("PDSERVE_") :].lower()
        if "__" in name:
            pool, field = name.split("__", 1)
            if pool in ("prefill", "decode"):
                out.setdefault(pool, {})[field] = value
        elif name in fields and name not in ("prefill", "decode"):
            out[name] = value
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(merged.get(k), Mapping):
            merged[k] = _merge(dict(merged[k]), v)
        else:
            merged[k] = v
    return merged


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeConfig:
    """YAML file < PDSERVE_* environment < ``overrides`` (CLI flags, nested dicts for pools).

    Raises:
        pydantic.ValidationError: naming every bad field.
        FileNotFoundError: the YAML file does not exist.
    """
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        data = loaded
    data = _merge(data, _env_overrides(os.environ if environ is None else environ))
    data = _merge(data, overrides or {})
    for pool, resource in (("prefill", "prefill_pool"), ("decode", "decode_pool")):
        if isinstance(data.get(pool), Mapping):
            data[pool] = {"resource": resource, **data[pool]}
    return ServeConfig.model_validate(data)
