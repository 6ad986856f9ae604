"""Gateway (ingress; a plain class, deployed by ``services.app``).

Request lifecycle through the gateway (disaggregated mode):
1. Validate the body, tokenize once (chat template for chat), refuse prompts over the context.
2. Pick the path: prefill pool then decode pool, or straight to the decode pool (colocated
   mode, or a prompt shorter than ``conditional_threshold``).
3. Prefill replica: first token + where its KV is held. Stream the first token to the client.
4. Decode replica: pulls the KV over the transport and streams the rest. A failed transfer is
   re-prefilled once, then the request fails with 503.
5. Record timings (queue, prefill, KV transfer, TTFT, every inter-token gap) as metrics.
Replica choice is Ray Serve's own load-aware routing for now (the prefix-aware router is a
later change).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.config import ServeConfig
from services.engine.errors import InvalidRequestError
from services.engine.loader import read_model_config, resolve_model
from services.engine.sampling_params import SamplingParams, check_prompt
from services.engine.tokenizer import Tokenizer
from services.pd_flow import GenerateSpec, KVTransferFailedError, TokenChunk, prefill_on_decode

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceUnavailableError(RuntimeError):
    """The cluster could not serve the request (HTTP 503 / UNAVAILABLE)."""


@dataclass(slots=True)
class Timing:
    start: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    ttft_s: float | None = None
    itls: list[float] = field(default_factory=list)
    last: float | None = None

    def token(self) -> None:
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
            "itl_mean_s": sum(self.itls) / len(self.itls) if self.itls else None,
            "e2e_s": (self.last or time.perf_counter()) - self.start,
        }


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.requests = Counter("pdserve_requests", "finished requests", ["status"], registry=r)
        self.reprefills = Counter(
            "pdserve_kv_reprefills", "requests re-prefilled after a failed KV transfer", registry=r
        )

    def observe(self, t: Timing) -> None:
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        for gap in t.itls:
            self.itl.observe(gap)
        self.queue.observe(t.queue_s)
        self.prefill.observe(t.prefill_s)
        self.transfer.observe(t.kv_transfer_s)
        self.e2e.observe((t.last or time.perf_counter()) - t.start)


class Gateway:
    """Args: handles to the prefill and decode deployments (Ray Serve handles, or any object
    with the same ``.remote`` / ``.options`` surface)."""

    def __init__(self, prefill: Any, decode: Any, cfg: ServeConfig) -> None:
        self.prefill = prefill
        self.decode = decode
        self.cfg = cfg
        folder, self.model_id = resolve_model(cfg.model)
        self.model_config = read_model_config(folder)
        self.tokenizer = Tokenizer.from_folder(folder)
        self.max_model_len = self.model_config.max_position_embeddings
        self.metrics = Metrics()

    # ---- request shaping (pure) ----------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise LookupError(
                f"model {model!r} does not exist; this server serves {self.model_id!r}"
            )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def spec(self, prompt_ids: list[int], params: SamplingParams) -> GenerateSpec:
        check_prompt(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)
        if params.seed is None:
            # NOTE: a seed chosen here makes the prefill, decode and any re-prefill replica all
            # sample the same continuation.
            params = replace(params, seed=secrets.randbits(63))
        return GenerateSpec(f"req-{secrets.token_hex(8)}", tuple(prompt_ids), params)

    # ---- the flow ------------------------------------------------------------------------
    async def generate(self, spec: GenerateSpec, timing: Timing) -> AsyncIterator[TokenChunk]:
        """Streams every token of the request, first token included."""
        deadline = self.cfg.request_timeout_s
        direct = prefill_on_decode(
            self.cfg.mode, len(spec.prompt_ids), 0, self.cfg.conditional_threshold
        )
        prefill = None
        if not direct:
            prefill = await self._prefill(spec, timing)
            timing.token()
            yield TokenChunk(
                (prefill.first_token,),
                prefill.first_text,
                (prefill.first_logprob,) if prefill.first_logprob is not None else None,
                prefill.finish_reason,
            )
            if prefill.finish_reason is not None:
                return
        for attempt in range(2):
            gen = self.decode.options(method_name="generate", stream=True).remote(spec, prefill)
            try:
                async for chunk in _with_deadline(gen, deadline):
                    timing.kv_transfer_s += chunk.kv_transfer_s
                    if chunk.token_ids:
                        timing.token()
                    yield chunk
                return
            except KVTransferFailedError as e:
                if attempt == 1:
                    raise ServiceUnavailableError(f"KV transfer failed twice: {e}") from None
                self.metrics.reprefills.inc()
                prefill = await self._prefill(spec, timing)  # same seed: same first token
            finally:
                gen.cancel()

    async def _prefill(self, spec: GenerateSpec, timing: Timing):  # -> PrefillResult
        try:
            result = await asyncio.wait_for(
                self.prefill.prefill.remote(spec), timeout=self.cfg.request_timeout_s
            )
        except TimeoutError:
            raise ServiceUnavailableError("prefill did not answer before the deadline") from None
        timing.queue_s = result.queue_s
        timing.prefill_s = result.prefill_s
        return result


async def _with_deadline(gen: Any, timeout_s: float) -> AsyncIterator[Any]:
    end = time.monotonic() + timeout_s
    it = gen.__aiter__()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise ServiceUnavailableError("the request passed its deadline")
        try:
            item = await asyncio.wait_for(it.__anext__(), timeout=left)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ServiceUnavailableError("the request passed its deadline") from None
        yield item
