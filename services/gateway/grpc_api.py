"""The public gRPC API (``pdserve.v1.Generation``) over a ``Gateway``, plus the standard
``grpc.health.v1`` health service and server reflection. Errors are mapped here, once.

Why a ``grpc.aio`` server the gateway runs, not Ray Serve's gRPC proxy: the proxy serves
only user servicers through its own request path; the standard health service, reflection,
TLS and an auth interceptor cannot be added to it, and a streaming call's cancellation and
deadline would reach the flow only through the proxy's own handling. Our server runs on the
gateway replica's event loop (started with the HTTP app's lifespan), so a cancelled or timed
out call cancels the flow directly: the decode stream is cancelled and the replica aborts the
request and frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams
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
    )
    params.validate()
    return params


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def _check_model(self, model: str) -> None:
        if model:
            self.gw.check_model(model)

    def _chat_ids(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise InvalidRequestError("chat.messages", "must hold at least one message")
        return self.gw.tokenizer.encode_chat(
            [{"role": m.role, "content": m.content} for m in chat.messages]
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        gw = self.gw
        try:
            self._check_model(request.model)
            if request.resume_from:
                raise NotImplementedError("resume_from is not supported yet")
            which = request.WhichOneof("prompt")
            if which == "text":
                ids = gw.prompt_ids(request.text)
            elif which == "chat":
                ids = self._chat_ids(request.chat)
            elif which == "token_ids":
                ids = list(request.token_ids.ids)
            else:
                raise InvalidRequestError("prompt", "set one of text, chat or token_ids")
            spec = gw.spec(ids, sampling_params(request.sampling))
        except Exception as e:
            await _abort(context, e)
        timing = Timing()
        n_out = 0
        finish = None
        try:
            async for c in gw.generate(spec, timing):
                n_out += len(c.token_ids)
                finish = c.finish_reason or finish
                chunk = pb.TokenChunk(token_ids=c.token_ids, text=c.text, logprobs=c.logprobs or ())
                yield pb.GenerateResponse(chunk=chunk)
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
            if which == "text":
                ids = self.gw.prompt_ids(request.text)
            elif which == "chat":
                ids = self._chat_ids(request.chat)
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


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else 0.0


def _status_label(e: BaseException) -> str:
    return "unavailable" if isinstance(e, ServiceUnavailableError) else "invalid"


async def _abort(context: grpc.aio.ServicerContext, e: BaseException) -> Any:
    """Raise the gRPC status for ``e`` (``context.abort`` never returns)."""
    if isinstance(e, InvalidRequestError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, LookupError):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found")
    if isinstance(e, ServiceUnavailableError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, NotImplementedError):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(e))
    raise e


async def start_grpc_server(gw: Gateway, host: str, port: int) -> grpc.aio.Server:
    """Serve the API, health and reflection on ``host:port`` on the running event loop."""
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(gw), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    for service in ("", name):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"gRPC API: cannot bind {host}:{port}")
    await server.start()
    return server
