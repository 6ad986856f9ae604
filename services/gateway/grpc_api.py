"""The public gRPC API (``pdserve.v1.Generation``) over a ``Gateway``, plus the standard
``grpc.health.v1`` health service and server reflection. Errors are mapped here, once.

Why a ``grpc.aio`` server the gateway runs, not Ray Serve's gRPC proxy: the proxy serves
only user servicers through its own request path; the standard health service, reflection,
TLS and an auth interceptor cannot be added to it, and a streaming call's cancellation and
deadline would reach the flow only through the proxy's own handling. Our server runs on the
gateway replica's event loop (started with the HTTP app's lifespan), so a cancelled or timed
out call cancels the flow directly: the decode stream is cancelled and the replica aborts the
request and frees its blocks.

Resumed streams (``resume_from = k``) are served by replay: the request runs again from its
prompt (the prefix cache usually holds it) and the first k tokens are dropped here. Greedy and
seeded sampling draw token i from (seed, i) alone, so the replay is the original stream; it
costs k decode steps, and needs no state kept between calls, so any gateway can resume any
stream. Chunks carry one token each (one engine step per chunk), so dropping whole chunks
drops exactly the text the client already has.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
from services.gateway.admission import OverloadedError
from services.gateway.gateway import Gateway, ServiceUnavailableError, Timing

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


def sampling_params(s: pb.SamplingParams) -> SamplingParams:
    """Proto -> engine parameters; unset optional fields take the documented defaults."""
    params = SamplingParams(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else 16,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        cache_salt=s.cache_salt if s.HasField("cache_salt") else None,
    )
    params.validate()
    return params


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def _check_model(self, model: str) -> None:
        if model:
            self.gw.check_model(model)

    async def _chat_ids(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise InvalidRequestError("chat.messages", "must hold at least one message")
        return await self.gw.tokenized(
            self.gw.chat_ids, [{"role": m.role, "content": m.content} for m in chat.messages]
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        gw = self.gw
        try:
            self._check_model(request.model)
            which = request.WhichOneof("prompt")
            if which == "text":
                ids = await gw.tokenized(gw.prompt_ids, request.text)
            elif which == "chat":
                ids = await self._chat_ids(request.chat)
            elif which == "token_ids":
                ids = list(request.token_ids.ids)
            else:
                raise InvalidRequestError("prompt", "set one of text, chat or token_ids")
            params = sampling_params(request.sampling)
            _check_resume(request, params)
            auth = dict(context.invocation_metadata() or ()).get("authorization")
            # NOTE: the interceptor refused unknown keys; this names the tenant of a known one
            spec = gw.spec(
                ids, params, gw.auth.tenant(auth if isinstance(auth, str) else None) or ""
            )
        except Exception as e:
            await _abort(context, e)
        timing = Timing()
        n_out = 0
        finish = None
        try:
            async with contextlib.aclosing(gw.generate(spec, timing)) as chunks:
                async for c in chunks:
                    out = _unseen(c, n_out, request.resume_from)
                    n_out += len(c.token_ids)
                    finish = c.finish_reason or finish
                    if out is not None:
                        yield pb.GenerateResponse(chunk=out)
        except Exception as e:
            gw.metrics.requests.labels(_status_label(e)).inc()
            await _abort(context, e)
        gw.metrics.observe(timing)
        gw.metrics.requests.labels("ok").inc()
        t = timing.as_dict()
        itls = sorted(timing.itls)
        yield pb.GenerateResponse(
            summary=pb.Summary(
                finish_reason=_FINISH.get(str(finish), pb.FINISH_REASON_UNSPECIFIED),
                usage=pb.Usage(
                    prompt_tokens=len(spec.prompt_ids),
                    completion_tokens=n_out,
                    cached_tokens=timing.num_cached_tokens,
                ),
                timing=pb.Timing(
                    queue_s=timing.queue_s,
                    prefill_s=timing.prefill_s,
                    kv_transfer_s=timing.kv_transfer_s,
                    first_token_s=timing.ttft_s or 0.0,
                    itl_mean_s=t["itl_mean_s"] or 0.0,
                    itl_p50_s=_pct(itls, 0.5),
                    itl_p99_s=_pct(itls, 0.99),
                    itl_max_s=itls[-1] if itls else 0.0,
                    e2e_s=t["e2e_s"] or 0.0,
                ),
                request_id=request.request_id or spec.request_id,
            )
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            self._check_model(request.model)
            which = request.WhichOneof("input")
            # NOTE: tokenizing is the whole cost of this RPC: admitted like a generation
            if which == "text":
                ids = await self.gw.tokenized(self.gw.prompt_ids, request.text)
            elif which == "chat":
                ids = await self._chat_ids(request.chat)
            else:
                raise InvalidRequestError("input", "set one of text or chat")
        except Exception as e:
            await _abort(context, e)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.gw.max_model_len)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        model = pb.Model(
            id=self.gw.model_id,
            max_model_len=self.gw.max_model_len,
            vocab_size=self.gw.model_config.vocab_size,
        )
        return pb.ListModelsResponse(models=[model])


def _unseen(c: Any, seen: int, resume_from: int) -> pb.TokenChunk | None:
    """The part of chunk ``c`` (after ``seen`` tokens of the stream) that a client holding
    ``resume_from`` tokens lacks; None when it has all of it (a resumed stream's replay)."""
    ids = c.token_ids[max(0, resume_from - seen) :]
    if (c.token_ids and not ids) or (not c.token_ids and seen < resume_from):
        return None
    # NOTE: chunks carry one token, so one is all replay or all new and its text goes whole
    lps = c.logprobs[len(c.logprobs) - len(ids) :] if c.logprobs else ()
    return pb.TokenChunk(token_ids=ids, text=c.text, logprobs=lps)


def _check_resume(request: pb.GenerateRequest, params: SamplingParams) -> None:
    k = request.resume_from
    if not k:
        return
    if params.temperature != 0 and params.seed is None:
        raise InvalidRequestError(
            "resume_from",
            "a stream can be resumed only for greedy (temperature 0) or seeded requests",
        )
    if not request.request_id:
        raise InvalidRequestError("request_id", "resume_from needs the original request's id")
    if k > params.max_tokens:
        raise InvalidRequestError(
            "resume_from", f"is {k}, more than max_tokens ({params.max_tokens})"
        )


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else 0.0


def _status_label(e: BaseException) -> str:
    if isinstance(e, OverloadedError):
        return "overloaded"
    return "unavailable" if isinstance(e, ServiceUnavailableError) else "invalid"


async def _abort(context: grpc.aio.ServicerContext, e: BaseException) -> Any:
    """Raise the gRPC status for ``e`` (``context.abort`` never returns)."""
    if isinstance(e, InvalidRequestError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, LookupError):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
    if isinstance(e, ServiceUnavailableError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, OverloadedError):
        ms = str(max(1, round(1000 * e.retry_after_s)))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), (("retry-after-ms", ms),))
    raise e


class _BearerToken(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without the configured token; health checks stay open (the
    orchestrator's probes carry no token)."""

    def __init__(self, gw: Gateway) -> None:
        self.auth = gw.auth

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        auth = dict(details.invocation_metadata or ()).get("authorization")
        if self.auth.ok(auth if isinstance(auth, str) else None):
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid bearer token is required (authorization metadata)",
            )

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def start_grpc_server(gw: Gateway, host: str, port: int) -> grpc.aio.Server:
    """Serve the API, health and reflection on ``host:port`` on the running event loop."""
    interceptors = [_BearerToken(gw)] if gw.auth.enabled else []
    # NOTE: the size cap is enforced by gRPC before a message is parsed (RESOURCE_EXHAUSTED)
    limit = gw.cfg.max_request_bytes
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", limit)],
    )
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(gw), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    for service in ("", name):  # NOT_SERVING until the cluster is ready (see readiness)
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    cfg = gw.cfg
    if cfg.grpc_tls_cert and cfg.grpc_tls_key:
        creds = grpc.ssl_server_credentials(
            [(Path(cfg.grpc_tls_key).read_bytes(), Path(cfg.grpc_tls_cert).read_bytes())]
        )
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC API: cannot bind {host}:{port}")
    await server.start()
    # NOTE: kept on the server so that the HTTP app's lifespan cancels it with the server
    server.pdserve_health_task = asyncio.create_task(  # type: ignore[attr-defined]
        _track_readiness(gw, health_servicer, ("", name))
    )
    return server


async def _track_readiness(gw: Gateway, servicer: Any, services: tuple[str, ...]) -> None:
    """The health service's status follows the gateway's readiness, checked every second."""
    serving = None
    while True:
        ready, _ = await gw.readiness.check()
        if ready is not serving:
            status = health_pb2.HealthCheckResponse.SERVING if ready else None
            status = status or health_pb2.HealthCheckResponse.NOT_SERVING
            for service in services:
                await servicer.set(service, status)
            serving = ready
        await asyncio.sleep(1.0)
