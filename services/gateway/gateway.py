"""Gateway (ingress; a plain class, deployed by ``services.app``).

Request lifecycle through the gateway (disaggregated mode):
1. Validate the body, tokenize once (chat template for chat), refuse prompts over the context.
2. Look the prompt's full blocks up in the prefix index (one round trip; hashed with the
   engine's own hash module). Pick the path: prefill pool then decode pool, or straight to
   the decode pool (colocated mode, or an *uncached* length, prompt minus the prefix the best
   decode replica holds, under ``conditional_threshold``). The hits go to the request
   router (``services.router``) with each call, which picks the replica.
3. Prefill replica (``handoff``): first token + a ``KVRef``, where its KV is held; the first
   token goes to the client. A layer-wise ref comes first, before the prefill ends, and the
   decode call starts right then, receiving each layer while the prefill computes the next.
   The gateway passes the ref on unread: the prefill replica decides how its KV travels.
4. Decode replica: receives the KV by the ref and streams the rest. A failed transfer is
   re-prefilled once (whole pull, fresh request id), then the request fails with 503.
5. Record timings (queue, prefill, KV transfer, TTFT, every inter-token gap) as metrics.
If the index fails (Redis down), routing falls back to load only for ``index_retry_s`` at a
time, counted in ``pdserve_prefix_index_errors`` and logged once per outage; serving goes on.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from ray.serve.exceptions import BackPressureError

from services import data_plane
from services.config import ServeConfig
from services.engine.block_hash import BlockHash, hash_blocks, salted_root
from services.engine.errors import InvalidRequestError
from services.engine.loader import read_model_config, resolve_model
from services.engine.sampling_params import SamplingParams, check_prompt
from services.engine.tokenizer import Tokenizer
from services.gateway.admission import Admission, OverloadedError
from services.gateway.auth import TokenCheck, tenant_salt
from services.gateway.readiness import Readiness
from services.gateway.vllm_metrics import VllmMetrics
from services.pd_flow import (
    GenerateSpec,
    KVRef,
    KVTransferFailedError,
    PrefillResult,
    RouteHint,
    TokenChunk,
    prefill_on_decode,
)
from services.replica import open_index
from services.router_registry import replica_reports

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceUnavailableError(RuntimeError):
    """The cluster could not serve the request (HTTP 503 / UNAVAILABLE)."""


class StreamCutError(ServiceUnavailableError):
    """A replica's stream stopped before its request finished (the replica died)."""


def replica_lost(e: BaseException) -> bool:
    """Did ``e`` come from a replica that died or stopped answering (worth resuming
    elsewhere), rather than from the request itself (which would fail the same way)?"""
    from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

    from services.engine.async_engine import EngineStalledError

    if isinstance(e, StreamCutError | RayActorError | ActorUnavailableError):
        return True
    return isinstance(e, RayTaskError) and isinstance(e.cause, EngineStalledError | RayActorError)


class Delivered:
    """What the client already has of a request's stream: its tokens and text. A replayed
    stream (the same request run again, same seed) is checked against them token by token
    and only what lies beyond them is passed on."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self._replay_ids: list[int] = []
        self._replay_text = ""
        self._scored = False  # the prompt's scores (prompt_logprobs) went out

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def restart(self) -> None:
        self._replay_ids, self._replay_text = [], ""

    def unseen(self, c: TokenChunk) -> TokenChunk | None:
        """``c`` minus what was delivered (None: nothing new and not the end). Raises
        ServiceUnavailableError (not resumable) when a replay disagrees with what was sent."""
        start = len(self._replay_ids)
        self._replay_ids.extend(c.token_ids)
        self._replay_text += c.text
        n = self.num_tokens
        if start < n:  # (part of) this chunk replays delivered tokens: they must match
            overlap = self._replay_ids[start : min(n, len(self._replay_ids))]
            if overlap != self.token_ids[start : start + len(overlap)]:
                raise ServiceUnavailableError(
                    "the resumed request did not replay the tokens already sent"
                )
        new_ids = self._replay_ids[max(n, start) :]
        new_text = self._replay_text[len(self.text) :]
        if not new_ids and not new_text and c.finish_reason is None:
            return None
        skip = max(0, n - start)
        lps = None if c.logprobs is None else tuple(c.logprobs[skip:])
        top = None if c.top_logprobs is None else tuple(c.top_logprobs[skip:])
        # NOTE: the prompt's scores go out once, with the first tokens delivered
        prompt = c.prompt_logprobs if n == 0 and not self._scored else None
        self._scored = self._scored or prompt is not None
        self.token_ids.extend(new_ids)
        self.text += new_text
        return replace(
            c,
            token_ids=tuple(new_ids),
            text=new_text,
            logprobs=lps,
            top_logprobs=top,
            prompt_logprobs=prompt,
        )


@dataclass(slots=True)
class Timing:
    start: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    ttft_s: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prefilled: bool = False
    itls: list[float] = field(default_factory=list)
    last: float | None = None
    num_output_tokens: int = 0

    def token(self, n: int = 1) -> None:
        """``n`` tokens arrived together (one chunk)."""
        self.num_output_tokens += n
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start
        elif self.last is not None:
            self.itls.append(now - self.last)
        self.last = now

    def as_dict(self) -> dict[str, float | None]:
        return {
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "kv_transfer_s": self.kv_transfer_s,
            "ttft_s": self.ttft_s,
            "num_cached_tokens": self.num_cached_tokens,
            "itl_mean_s": sum(self.itls) / len(self.itls) if self.itls else None,
            "e2e_s": (self.last or time.perf_counter()) - self.start,
        }


class Metrics:
    """pdserve's series, and vLLM's names beside them (``vllm``) when ``model_name`` is given."""

    def __init__(
        self,
        model_name: str | None = None,
        pools: Sequence[str] = (),
        reports: Callable[[str], Sequence[dict[str, Any]]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = None
        if model_name is not None:
            self.vllm = VllmMetrics(r, model_name, pools, reports or (lambda _pool: ()))
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdserve_itl_seconds", "inter-token latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve_e2e_seconds", "end-to-end latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "pdserve_queue_seconds", "prefill queue time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prefill = Histogram(
            "pdserve_prefill_seconds", "prefill compute time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.transfer = Histogram(
            "pdserve_kv_transfer_seconds", "KV transfer time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.transfer_bytes = Histogram(
            "pdserve_kv_transfer_bytes",
            "KV bytes moved per request",
            buckets=[float(2**k) for k in range(16, 34, 2)],
            registry=r,
        )
        self.requests = Counter("pdserve_requests", "finished requests", ["status"], registry=r)
        self.resumes = Counter(
            "pdserve_resumes",
            "requests run again after a replica died or its stream was cut (mid-stream failover)",
            registry=r,
        )
        self.reprefills = Counter(
            "pdserve_kv_reprefills", "requests re-prefilled after a failed KV transfer", registry=r
        )
        # prefix cache across the cluster; hit rates = hit / prompt tokens, hit / requests
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens", registry=r)
        self.prefix_hit_tokens = Counter(
            "pdserve_prefix_hit_tokens",
            "prompt tokens served from a prefix cache (prefill compute saved)",
            registry=r,
        )
        self.prefix_requests = Counter(
            "pdserve_prefix_requests",
            "prefilled requests, by prefix cache hit",
            ["hit"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "pdserve_prefix_hit_rate", "prefix hit rate since start", ["unit"], registry=r
        )
        self.lookup = Histogram(
            "pdserve_prefix_lookup_seconds",
            "prefix index lookup latency",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1),
            registry=r,
        )
        self.index_errors = Counter(
            "pdserve_prefix_index_errors", "failed prefix index lookups", registry=r
        )
        self.index_up = Gauge(
            "pdserve_prefix_index_up", "1 while routing uses the prefix index", registry=r
        )
        self._hits = [0, 0, 0, 0]  # hit tokens, prompt tokens, hit requests, requests

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        if self.vllm is not None:
            self.vllm.observe_prefix(prompt_tokens, cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_hit_tokens.inc(cached_tokens)
        self.prefix_requests.labels(str(cached_tokens > 0).lower()).inc()
        h = self._hits
        h[0] += cached_tokens
        h[1] += prompt_tokens
        h[2] += cached_tokens > 0
        h[3] += 1
        self.prefix_hit_rate.labels("tokens").set(h[0] / max(1, h[1]))
        self.prefix_hit_rate.labels("requests").set(h[2] / h[3])

    def observe(self, t: Timing) -> None:
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        for gap in t.itls:
            self.itl.observe(gap)
        self.queue.observe(t.queue_s)
        self.prefill.observe(t.prefill_s)
        self.transfer.observe(t.kv_transfer_s)
        if t.kv_transfer_bytes:
            self.transfer_bytes.observe(t.kv_transfer_bytes)
        e2e = (t.last or time.perf_counter()) - t.start
        self.e2e.observe(e2e)
        if self.vllm is not None:
            self.vllm.observe(t.ttft_s, t.itls, e2e, t.num_output_tokens)


class Gateway:
    """Args: handles to the prefill and decode deployments (Ray Serve handles, or any object
    with the same ``.remote`` / ``.options`` surface); index_handle: the application's
    ``prefix_index`` deployment when the index is in-process (no ``redis_url``)."""

    def __init__(
        self, prefill: Any, decode: Any, cfg: ServeConfig, index_handle: Any = None
    ) -> None:
        self.prefill = data_plane.on(prefill, cfg.serve_data_plane)
        self.decode = data_plane.on(decode, cfg.serve_data_plane)
        self.cfg = cfg
        self.index = open_index(cfg, index_handle)
        self._index_down_until = 0.0  # monotonic; > now while routing ignores the index
        folder, self.model_id = resolve_model(cfg.model, weights=False)  # config, tokenizer
        self.model_id = cfg.served_model_name or self.model_id
        self.model_config = read_model_config(folder)
        self.tokenizer = Tokenizer.from_folder(folder)
        # NOTE: as the engines compute it (the model's, capped by KV capacity where the config
        # fixes it), so a request that leaves max_tokens out asks for what fits
        limits = (cfg.max_model_len, cfg.kv_capacity_tokens())
        self.max_model_len = min(
            [self.model_config.max_position_embeddings, *(x for x in limits if x is not None)]
        )
        pools = ["decode"] if prefill is None else ["prefill", "decode"]
        self.pools = tuple(pools)
        self.metrics = Metrics(self.model_id, pools, replica_reports)
        self.metrics.index_up.set(1 if self.index is not None else 0)
        self.admission = Admission(
            cfg.max_inflight_requests, cfg.retry_after_s, self.metrics.registry
        )
        self.auth = TokenCheck(cfg.auth_token, cfg.api_keys)
        self.readiness = Readiness(["decode"] if prefill is None else ["prefill", "decode"])

    # ---- lifecycle -----------------------------------------------------------------------
    def drain(self) -> None:
        """Stop admitting (readiness fails, new requests get 503); in-flight ones go on."""
        self.readiness.drain()

    def inflight(self) -> int:
        """Requests this gateway is serving now (a draining launcher waits for 0)."""
        return self.admission.inflight

    def _admit(self) -> None:
        if self.readiness.draining:
            raise ServiceUnavailableError("the server is shutting down; retry elsewhere")

    # ---- request shaping (pure) ----------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise LookupError(
                f"model {model!r} does not exist; this server serves {self.model_id!r}"
            )

    async def tokenized(self, fn: Callable[..., list[int]], *args: object) -> list[int]:
        """``fn(*args)`` (a tokenizer call) on a worker thread, admitted like a request: a
        long prompt never stalls the event loop, and under overload nothing is tokenized."""
        self._admit()
        with self.admission.slot():
            return await asyncio.to_thread(fn, *args)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat's prompt ids; markup typed in a message is text unless
        ``special_tokens_in_messages`` (services.engine.tokenizer.Tokenizer.encode_chat)."""
        return self.tokenizer.encode_chat(messages, self.cfg.special_tokens_in_messages)

    def doctor_evidence(self) -> dict[str, Any]:
        """The cluster as ``pdserve doctor`` reads it: how it serves, and per pool each engine
        replica's profile, counters and step costs (their latest reports, at most
        ``routing_stats_period_s`` old)."""
        cfg = self.cfg
        return {
            "model": self.model_id,
            "mode": cfg.mode,
            "conditional_threshold": cfg.conditional_threshold,
            "routing": cfg.routing,
            "max_model_len": self.max_model_len,
            "pools": {
                pool: [r["doctor"] for r in replica_reports(pool) if "doctor" in r]
                for pool in self.pools
            },
        }

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def spec(self, prompt_ids: list[int], params: SamplingParams, tenant: str = "") -> GenerateSpec:
        """``tenant``: whose key the caller presented (its prefix cache is its own)."""
        check_prompt(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)
        if tenant:
            params = replace(params, cache_salt=tenant_salt(tenant, params.cache_salt))
        if params.seed is None:
            # NOTE: a seed chosen here makes the prefill, decode and any re-prefill replica all
            # sample the same continuation.
            params = replace(params, seed=secrets.randbits(63))
        return GenerateSpec(f"req-{secrets.token_hex(8)}", tuple(prompt_ids), params)

    @staticmethod
    def isolate_calls() -> None:
        """Give this task's replica calls their own Ray Serve request id. Serve takes a call's
        internal id from the HTTP request's context, and concurrent calls with one id to the
        same deployment collide in its router's bookkeeping (and ours): the calls of a
        request's several choices stalled. NOTE: Serve's context variable is private API;
        outside a Serve replica there is none, and nothing is done."""
        try:
            from ray.serve import context
            from ray.serve._private.utils import generate_request_id
        except ImportError:
            return
        var = getattr(context, "_serve_request_context", None)
        if var is None:
            return
        ctx = var.get()
        if ctx is not None:
            var.set(replace(ctx, _internal_request_id=generate_request_id()))

    # ---- the flow ------------------------------------------------------------------------
    async def generate(self, spec: GenerateSpec, timing: Timing) -> AsyncIterator[TokenChunk]:
        """Streams every token of the request, first token included. Raises OverloadedError
        (before any token) when this gateway or a pool's queue is full."""
        self._admit()
        with self.admission.slot():
            try:
                async for chunk in self._flow(spec, timing):
                    yield chunk
            except BackPressureError:  # a pool's max_queued_requests reached
                raise OverloadedError(
                    "the cluster's request queues are full; retry later", self.cfg.retry_after_s
                ) from None

    async def _flow(self, spec: GenerateSpec, timing: Timing) -> AsyncIterator[TokenChunk]:
        """The request's stream, resumed across replica failures: when a prefill or decode
        replica dies (or its stream is cut) the request runs again on the replicas still
        serving, with a fresh id and the same seed, and its replay is checked against and
        stripped of what the client already has (``Delivered``), so every token arrives
        exactly once. Tried again with backoff until ``resume_timeout_s`` after the first
        failure; then the stream ends with ServiceUnavailableError, never as a success."""
        delivered = Delivered()
        give_up_at: float | None = None
        attempt = 0
        while True:
            s = spec if attempt == 0 else replace(spec, request_id=f"{spec.request_id}-r{attempt}")
            delivered.restart()
            try:
                async for chunk in self._attempt(s, timing):
                    out = delivered.unseen(chunk)
                    if out is not None:
                        if out.token_ids:
                            timing.token(len(out.token_ids))
                        yield out
                return
            except Exception as e:
                if not replica_lost(e):
                    raise
                now = time.monotonic()
                give_up_at = give_up_at or now + self.cfg.resume_timeout_s
                if now >= give_up_at:
                    raise ServiceUnavailableError(
                        f"the request could not be resumed after {attempt + 1} attempts: {e}"
                    ) from None
                self.metrics.resumes.inc()
                log.warning(
                    "request %s: %s after %d tokens; resuming (attempt %d)",
                    spec.request_id, type(e).__name__, delivered.num_tokens, attempt + 1,
                )  # fmt: skip
                await asyncio.sleep(min(4.0, 0.25 * 2**attempt))  # backoff: let Serve replace it
                attempt += 1

    async def _attempt(self, spec: GenerateSpec, timing: Timing) -> AsyncIterator[TokenChunk]:
        """One run of the request through the pools: prefill (or not), then decode."""
        deadline = self.cfg.request_timeout_s
        n = len(spec.prompt_ids)
        aware = self.cfg.routing == "prefix_aware"
        # NOTE: hashed only under prefix-aware routing, the one that reads them (the index's
        # lookup, the router's memory of what it sent where; least_loaded opens no index)
        hashes = self.prompt_hashes(spec.prompt_ids, spec.params.cache_salt) if aware else []
        cached = await self.lookup(hashes)
        on_decode = {k: v for k, v in cached.items() if k.startswith("decode-")}
        direct = prefill_on_decode(
            self.cfg.mode, n, max(on_decode.values(), default=0), self.cfg.conditional_threshold
        )
        bs = self.cfg.block_size
        blocks = -(-(n + spec.params.max_tokens) // bs)
        held = tuple(hashes) if aware else ()
        if direct:
            decode_route = RouteHint(n, on_decode, True, blocks, aware, held, bs)
        else:
            decode_route = RouteHint(n, {}, False, blocks, aware)
            prefill_route = RouteHint(n, cached, True, blocks, aware, held, bs)
        kv: KVRef | None = None
        receiving = None  # a decode call already receiving the KV layer by layer
        try:
            if not direct:
                result, receiving = await self._handoff(spec, timing, prefill_route, decode_route)
                kv = result.kv
                yield TokenChunk(
                    (result.first_token,),
                    result.first_text,
                    (result.first_logprob,) if result.first_logprob is not None else None,
                    result.finish_reason,
                    top_logprobs=(
                        (result.first_top_logprobs,)
                        if result.first_top_logprobs is not None
                        else None
                    ),
                    prompt_logprobs=result.prompt_logprobs,
                )
                if result.finish_reason is not None:  # ended at its first token
                    if receiving is not None:
                        receiving.cancel()
                    return
        except BaseException:
            if receiving is not None:
                receiving.cancel()
            raise
        for attempt in range(2):
            gen = receiving or self.decode.options(method_name="generate", stream=True).remote(
                spec, kv, route=decode_route
            )
            receiving = None
            first = True
            finished = False
            try:
                async for chunk in _with_deadline(gen, deadline):
                    if first and direct:  # prefilled on the decode replica
                        self._observe_prefix(n, chunk.num_cached_tokens, timing)
                    first = False
                    timing.kv_transfer_s += chunk.kv_transfer_s
                    timing.kv_transfer_bytes += chunk.kv_transfer_bytes
                    finished = chunk.finish_reason is not None
                    yield chunk
                if not finished:
                    # NOTE: a decode stream that stops without a finish reason was cut (its
                    # replica died): resumed, or an explicit error; never a truncated success
                    raise StreamCutError("the decode stream ended before the request finished")
                return
            except KVTransferFailedError as e:
                if attempt == 1:
                    # NOTE: the cause's message, not Ray's wrapper (a replica's traceback,
                    # paths and addresses are not the client's to read)
                    cause = getattr(e, "cause", None) or e
                    raise ServiceUnavailableError(f"KV transfer failed twice: {cause}") from None
                self.metrics.reprefills.inc()
                # NOTE: a fresh id: the first prefill may still run (or hold) under the old
                # one; the same seed gives the same first token
                spec = replace(spec, request_id=f"{spec.request_id}-retry")
                result, _ = await self._handoff(spec, timing, prefill_route, None)
                kv = result.kv
            finally:
                gen.cancel()

    async def _handoff(
        self,
        spec: GenerateSpec,
        timing: Timing,
        route: RouteHint,
        decode_route: RouteHint | None,
    ) -> tuple[PrefillResult, Any]:
        """The prefill and its ``KVRef``. When the prefill replica hands a layer-wise ref
        first, the decode call starts at once (``decode_route``; None asks for a whole pull:
        the re-prefill) and receives the KV while the prefill runs. Returns (the prefill's
        result, that decode call or None)."""
        calls = self.prefill.options(method_name="handoff", stream=True).remote(
            spec, route=route, layerwise=decode_route is not None
        )
        receiving = None
        result: PrefillResult | None = None
        try:
            async for item in _with_deadline(calls, self.cfg.request_timeout_s):
                if isinstance(item, KVRef):
                    assert decode_route is not None and item.layerwise
                    receiving = self.decode.options(method_name="generate", stream=True).remote(
                        spec, item, route=decode_route
                    )
                else:
                    result = item
        except BaseException:
            if receiving is not None:
                receiving.cancel()
            raise
        finally:
            calls.cancel()
        if result is None:
            if receiving is not None:
                receiving.cancel()
            raise ServiceUnavailableError("the prefill stream ended early")
        self._record_prefill(spec, timing, result)
        return result, receiving

    def _record_prefill(self, spec: GenerateSpec, timing: Timing, result: PrefillResult) -> None:
        timing.queue_s = result.queue_s
        timing.prefill_s = result.prefill_s
        self._observe_prefix(len(spec.prompt_ids), result.num_cached_tokens, timing)

    def _observe_prefix(self, prompt_tokens: int, cached_tokens: int, timing: Timing) -> None:
        # NOTE: what the replica's engine actually reused, not what the index predicted
        if not timing.prefilled:  # a re-prefill is not a second request
            self.metrics.observe_prefix(prompt_tokens, cached_tokens)
        timing.prefilled = True
        timing.num_cached_tokens = cached_tokens

    def prompt_hashes(
        self, prompt_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The block hashes a replica may hold of the prompt: of ``prompt[:-1]``, since the
        engine always computes the last prompt token (its logits give the first token)."""
        return hash_blocks(prompt_ids[:-1], self.cfg.block_size, salted_root(cache_salt))

    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Index replica id -> prompt tokens it holds; {} when routing by load only."""
        if self.index is None or time.monotonic() < self._index_down_until or not hashes:
            return {}
        t = time.perf_counter()
        try:
            found = await asyncio.to_thread(self.index.lookup, hashes)
        except Exception as e:  # Redis down, timeout, index replica gone: route by load
            self.metrics.index_errors.inc()
            if self._index_down_until == 0.0:
                log.warning("prefix index unavailable (%s); routing by load only", e)
            self._index_down_until = time.monotonic() + self.cfg.index_retry_s
            self.metrics.index_up.set(0)
            return {}
        self.metrics.lookup.observe(time.perf_counter() - t)
        if self._index_down_until != 0.0:
            log.warning("prefix index is back; prefix-aware routing resumed")
            self._index_down_until = 0.0
            self.metrics.index_up.set(1)
        return {r: nb * self.cfg.block_size for r, nb in found.items()}


async def _with_deadline(gen: Any, timeout_s: float) -> AsyncIterator[Any]:
    """``gen``'s items until ``timeout_s`` from now; then ServiceUnavailableError. NOTE: a
    timer per item around the awaited ``__anext__`` (``asyncio.timeout_at``), not
    ``asyncio.wait_for``: that ran each item's wait as a task of its own, one more task and
    event-loop hop per streamed token."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    it = gen.__aiter__()
    while True:
        if loop.time() >= end:
            raise ServiceUnavailableError("the request passed its deadline")
        try:
            async with asyncio.timeout_at(end):
                item = await it.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ServiceUnavailableError("the request passed its deadline") from None
        yield item
