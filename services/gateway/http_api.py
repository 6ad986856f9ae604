"""OpenAI-compatible HTTP API over a ``Gateway``: /v1/completions, /v1/chat/completions
(SSE with ``stream: true``), /v1/models, /tokenize and /detokenize (vLLM's), /version,
/health (liveness), /ready (readiness), /metrics.
Errors are mapped here, once."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.datastructures import Headers

from services.engine.errors import InvalidRequestError, RequestFailedError
from services.gateway import logprobs
from services.gateway.admission import OverloadedError
from services.gateway.body import PayloadTooLargeError, check_size, decode
from services.gateway.choices import MergedFlows, choice_seed
from services.gateway.gateway import Gateway, ServiceUnavailableError, Timing
from services.gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)

log = logging.getLogger(__name__)


def error_body(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "overloaded_error",
        503: "service_unavailable",
    }.get(status, "internal_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


class SourceClosingResponse(StreamingResponse):
    """A stream whose body and source (the request's token flow: its admission slot, its
    replicas' work) are closed however the response ends. Invariant: the slot is given back
    as the client goes away. Starlette cancels the body's consumer on a disconnect without
    closing the body (suspended at a ``yield`` while a send waits; or never started), whose
    ``finally`` closes the source, so the flow stayed open until garbage collection: 2 slots
    of 16 were still held 40 s after a cancel storm."""

    def __init__(self, content: AsyncIterator[str], source: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._source = source

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._source.aclose()  # NOTE: the body's own finally does not run unstarted


class BearerAuth:
    """The API keys' check (``Authorization: Bearer``) as plain ASGI middleware: a request
    without a valid key gets 401 (the probes' and the scrape's paths excepted); the key's
    tenant goes to ``request.state.tenant``. NOTE: not Starlette's ``BaseHTTPMiddleware``
    (``@app.middleware``): that runs every response through a memory stream and a task of its
    own, one more event-loop hop per streamed token, keys configured or not."""

    def __init__(self, app: Any, gw: Gateway, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.gw = gw
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.gw.auth.enabled:
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # Serve mounts the app under its route prefix
            path = path[len(root) :]
        tenant = self.gw.auth.tenant(Headers(scope=scope).get("authorization"))
        if path not in self.open_paths and tenant is None:
            r = error_body(401, "a valid bearer token is required (Authorization header)")
            r.headers["WWW-Authenticate"] = "Bearer"
            await r(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant or ""
        await self.app(scope, receive, send)


def build_http_app(gw: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # the gRPC API shares the gateway's event loop and lifetime (see grpc_api)
        server = None
        if gw.cfg.grpc_port:
            from services.gateway.grpc_api import start_grpc_server

            server = await start_grpc_server(gw, gw.cfg.http_host, gw.cfg.grpc_port)
        yield
        if server is not None:
            server.pdserve_health_task.cancel()
            await server.stop(5)

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    open_paths = ("/health", "/ready", "/metrics")  # probes and Prometheus scrape: no token

    app.add_middleware(BearerAuth, gw=gw, open_paths=open_paths)

    @app.exception_handler(InvalidRequestError)
    async def _bad(_: Request, e: InvalidRequestError) -> JSONResponse:
        gw.metrics.requests.labels("invalid").inc()
        # NOTE: errors raised inside a replica arrive wrapped by Ray (a subclass of the cause)
        return error_body(400, str(e), getattr(e, "field", None))

    @app.exception_handler(PayloadTooLargeError)
    async def _too_large(_: Request, e: PayloadTooLargeError) -> JSONResponse:
        gw.metrics.requests.labels("invalid").inc()
        return error_body(413, str(e), e.field)

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, e: RequestFailedError) -> JSONResponse:
        gw.metrics.requests.labels("error").inc()
        return error_body(500, f"the request failed: {e}")

    @app.exception_handler(LookupError)
    async def _missing(_: Request, e: LookupError) -> JSONResponse:
        return error_body(404, str(e.args[0]) if e.args else "not found", "model")

    @app.exception_handler(ServiceUnavailableError)
    async def _unavailable(_: Request, e: ServiceUnavailableError) -> JSONResponse:
        gw.metrics.requests.labels("unavailable").inc()
        return error_body(503, str(e))

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, e: OverloadedError) -> JSONResponse:
        gw.metrics.requests.labels("overloaded").inc()
        r = error_body(429, str(e))
        r.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
        return r

    async def body_of(request: Request) -> Any:
        """The decoded body (services.gateway.body): its size is bounded before it is read."""
        limit = gw.cfg.max_request_bytes
        declared = request.headers.get("content-length", "")
        check_size(int(declared) if declared.isdigit() else None, limit)
        chunks, n = [], 0
        async for chunk in request.stream():  # NOTE: a chunked body has no Content-Length
            n += len(chunk)
            if n > limit:
                raise PayloadTooLargeError(None, limit)
            chunks.append(chunk)
        return decode(b"".join(chunks))

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: this process answers (cheap; a failing probe restarts the pod)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the cluster behind this gateway can serve (services.gateway.readiness);
        503 with the reason while models load, a pool has no replica, or it drains."""
        ok, why = await gw.readiness.check()
        if ok:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": why}, 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(gw.metrics.registry).decode(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/pdserve/doctor")
    async def doctor() -> dict[str, Any]:
        """What ``pdserve doctor`` reads from a live cluster (behind the API token)."""
        return gw.doctor_evidence()

    @app.get("/version")
    async def version() -> dict[str, str]:
        from services.cli import pdserve_version

        return {"version": pdserve_version()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": gw.model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": gw.max_model_len,
                }
            ],
        }

    def _logprobs(params, chat, ids, lps, top, offset=0):  # type: ignore[no-untyped-def]
        """OpenAI's logprobs body for these tokens, and the completion text offset after
        them (``services.gateway.logprobs``)."""
        alts = top if params.top_logprobs else None
        if chat:
            return logprobs.chat(gw.tokenizer, ids, lps, alts), offset
        return logprobs.completion(gw.tokenizer, ids, lps, alts, offset)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = parse(TokenizeRequest, await body_of(request))
        if req.model is not None:
            gw.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("prompt", "send exactly one of prompt and messages")
        if req.messages is not None:
            msgs = [m.model_dump() for m in req.messages]
            ids = await gw.tokenized(gw.chat_ids, msgs)
        else:
            ids = await gw.tokenized(gw.tokenizer.encode, req.prompt, req.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": gw.max_model_len, "tokens": ids}
        out["token_strs"] = (
            [gw.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        )
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        req: DetokenizeRequest = parse(DetokenizeRequest, await body_of(request))
        if req.model is not None:
            gw.check_model(req.model)
        vocab = gw.model_config.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"tokens.{i}", f"{t} is not a token id (vocab {vocab})")
        return {"prompt": await gw.tokenized(gw.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        req = parse(CompletionRequest, await body_of(request))
        assert isinstance(req, CompletionRequest)
        gw.check_model(req.model)
        params = req.params(16)
        texts = req.prompts()
        prompts = [await gw.tokenized(gw.prompt_ids, p) for p in texts]
        specs = choice_specs(prompts, req.n, params, _tenant(request))
        echo = None
        if req.echo:  # the prompt as sent; a token-id prompt as its text (off the event loop)
            shown = [
                t if isinstance(t, str) else await gw.tokenized(_decode_all, gw.tokenizer, t)
                for t in texts
            ]
            echo = [t for t in shown for _ in range(req.n)]
        return await respond(
            specs, req.n, req.stream, chat=False, usage_event=req.usage_events, echo=echo
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        req = parse(ChatCompletionRequest, await body_of(request))
        assert isinstance(req, ChatCompletionRequest)
        gw.check_model(req.model)
        ids = await gw.tokenized(gw.chat_ids, [m.model_dump() for m in req.messages])
        default = req.max_completion_tokens or max(1, gw.max_model_len - len(ids))
        specs = choice_specs([ids], req.n, req.params(default), _tenant(request))
        return await respond(specs, req.n, req.stream, chat=True, usage_event=req.usage_events)

    def choice_specs(prompts, n, params, tenant):  # type: ignore[no-untyped-def]
        """One spec per choice: prompt p's choice i is choice p * n + i (OpenAI's order)."""
        return [
            gw.spec(ids, replace(params, seed=choice_seed(params.seed, i)), tenant)
            for ids in prompts
            for i in range(n)
        ]

    def usage_of(specs, n, n_out, timings):  # type: ignore[no-untyped-def]
        """Each prompt counted once (its first choice's), every choice's output."""
        firsts = range(0, len(specs), n)
        return usage(
            sum(len(specs[j].prompt_ids) for j in firsts),
            n_out,
            sum(timings[j].num_cached_tokens for j in firsts),
        )

    def echoed(spec, echo, j, scores):  # type: ignore[no-untyped-def]
        """Choice ``j``'s echoed prompt: its text, and its logprobs body when asked for."""
        if echo is None:
            return "", None
        if not spec.params.logprobs:
            return echo[j], None
        try:
            body = logprobs.prompt(
                gw.tokenizer, spec.prompt_ids, scores, bool(spec.params.top_logprobs)
            )
        except ValueError as e:  # a replica lost the scores: an error, never a silent gap
            raise ServiceUnavailableError(f"echo: {e}") from None
        return echo[j], body

    async def respond(
        specs, n: int, stream: bool, chat: bool, usage_event: str | None = None, echo=None
    ):  # type: ignore[no-untyped-def]
        timings = [Timing() for _ in specs]
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + specs[0].request_id
        # NOTE: every flow's first chunk before answering, so refusals keep their status code
        merged = MergedFlows(
            [gw.generate(s, t) for s, t in zip(specs, timings, strict=True)],
            leaders=range(0, len(specs), n),
            isolate=gw.isolate_calls,
        )
        await merged.start()
        if not stream:
            ids: list[list[int]] = [[] for _ in specs]
            text: list[list[str]] = [[] for _ in specs]
            lps: list[list[float]] = [[] for _ in specs]
            top: list[list[tuple[tuple[int, float], ...]]] = [[] for _ in specs]
            finish: list[str | None] = [None for _ in specs]
            scores: list[Any] = [None for _ in specs]
            try:
                async for j, c in merged:
                    scores[j] = scores[j] or c.prompt_logprobs
                    ids[j].extend(c.token_ids)
                    text[j].append(c.text)
                    lps[j].extend(c.logprobs or ())
                    top[j].extend(c.top_logprobs or ())
                    finish[j] = c.finish_reason or finish[j]
            finally:
                await merged.aclose()
            for t in timings:
                gw.metrics.observe(t)
            gw.metrics.requests.labels("ok").inc()
            choices = []
            for j, spec in enumerate(specs):
                choice: dict[str, Any] = {
                    "index": j,
                    "finish_reason": finish[j],
                    "token_ids": ids[j],
                }
                head, head_lps = echoed(spec, echo, j, scores[j])
                if chat:
                    choice["message"] = {"role": "assistant", "content": "".join(text[j])}
                else:
                    choice["text"] = head + "".join(text[j])
                if spec.params.logprobs:
                    body = _logprobs(spec.params, chat, ids[j], lps[j], top[j], len(head))[0]
                    choice["logprobs"] = (
                        body if head_lps is None else logprobs.joined(head_lps, body)
                    )
                choices.append(choice)
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": gw.model_id,
                "choices": choices,
                "usage": usage_of(specs, n, sum(map(len, ids)), timings),
                "pdserve_timing": timings[0].as_dict(),
            }
        return SourceClosingResponse(
            sse(specs, n, rid, created, chat, merged, timings, usage_event, echo),
            merged,
            media_type="text/event-stream",
        )

    async def sse(
        specs, n, rid, created, chat, merged, timings, usage_event, echo
    ) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
        """Content events (every one with a choice, so clients may read ``choices[0]``; with
        ``usage_event`` "continuous" each carries ``usage`` so far), then, only when the client
        asked (``stream_options.include_usage``, as OpenAI), one event with ``usage`` and
        ``pdserve_timing`` and empty ``choices``; then ``[DONE]``."""
        n_out = 0
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(specs)  # characters streamed per choice (completions' text_offset)
        started = [False] * len(specs)

        def event(j, c) -> str:  # type: ignore[no-untyped-def]
            spec = specs[j]
            head, head_lps = "", None
            if not started[j]:  # the echoed prompt leads the choice's first event
                started[j] = True
                head, head_lps = echoed(spec, echo, j, c.prompt_logprobs)
                offsets[j] = len(head)
            choice: dict[str, Any] = {
                "index": j,
                "finish_reason": c.finish_reason,
                "token_ids": list(c.token_ids),
            }
            if chat:
                choice["delta"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = head + c.text
            if spec.params.logprobs:
                lps = list(c.logprobs or ())[: len(c.token_ids)]
                top = list(c.top_logprobs or ())[: len(c.token_ids)]
                choice["logprobs"], offsets[j] = _logprobs(
                    spec.params, chat, list(c.token_ids), lps, top, offsets[j]
                )
                if head_lps is not None:
                    choice["logprobs"] = logprobs.joined(head_lps, choice["logprobs"])
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": gw.model_id,
                "choices": [choice],
            }
            if usage_event == "continuous":  # vLLM's continuous_usage_stats: usage so far
                body["usage"] = usage_of(specs, n, n_out, timings)
            return "data: " + json.dumps(body) + "\n\n"

        try:
            async for j, c in merged:
                n_out += len(c.token_ids)
                yield event(j, c)
            if usage_event:
                tail = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": gw.model_id,
                    "choices": [],
                    "usage": usage_of(specs, n, n_out, timings),
                    "pdserve_timing": timings[0].as_dict(),
                }
                yield "data: " + json.dumps(tail) + "\n\n"
            yield "data: [DONE]\n\n"
            for t in timings:
                gw.metrics.observe(t)
            gw.metrics.requests.labels("ok").inc()
        except (ServiceUnavailableError, OverloadedError) as e:
            # NOTE: after the 200 the status travels in the event (OpenAI's convention)
            code = 429 if isinstance(e, OverloadedError) else 503
            gw.metrics.requests.labels("overloaded" if code == 429 else "unavailable").inc()
            kind = "overloaded_error" if code == 429 else "service_unavailable"
            yield (
                "data: "
                + json.dumps({"error": {"message": str(e), "type": kind, "code": code}})
                + "\n\n"
            )
        except Exception as e:  # whatever else ended it: an explicit error, never a success
            log.exception("stream %s failed", rid)
            gw.metrics.requests.labels("error").inc()
            err = {"message": f"the request failed: {e}", "type": "internal_error", "code": 500}
            yield "data: " + json.dumps({"error": err}) + "\n\n"
        finally:
            await merged.aclose()

    return app


def _decode_all(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _tenant(request: Request) -> str:
    """Whose key the auth middleware found ("": no keys configured)."""
    return getattr(request.state, "tenant", "")
