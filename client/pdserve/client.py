"""Python SDK of pdserve's gRPC API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from pdserve.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate("The capital of France is", max_tokens=8, temperature=0):
            print(chunk.text, end="")
        result = c.complete("Hello", max_tokens=16)   # .text, .token_ids, .ttft_s, .itl_s

Calls take a ``timeout`` (seconds; one deadline for the whole call, retries included).
A call that fails with UNAVAILABLE (no replica, a dropped connection) or RESOURCE_EXHAUSTED
(overload; the server's ``retry-after-ms`` hint sets the wait) is retried up to ``retries``
times. Before the first token it is simply re-sent. After it, a greedy or seeded request is
*resumed*: re-sent with its request id and ``resume_from`` = the tokens already received, and
the server continues without repeating or losing a token; any other request fails (its tokens
cannot be reproduced). Client-side TTFT and inter-token gaps are measured on every result.

Security: ``token`` sends ``authorization: Bearer <token>`` on every call; ``tls=True`` (or
``root_certificates``, PEM bytes or a file path, for a private CA) uses a TLS channel.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]


@dataclass(slots=True)
class Result:
    """A whole generation: tokens, text, the server's summary and client-side latency."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    server_timing: dict[str, float] = field(default_factory=dict)
    request_id: str = ""
    ttft_s: float | None = None  # measured here: from the call to the first token
    itl_s: list[float] = field(default_factory=list)  # gaps between token arrivals
    resumes: int = 0  # times a broken stream was resumed


def request(
    prompt: Prompt, *, model: str = "", request_id: str = "", **sampling: Any
) -> pb.GenerateRequest:
    """Build a GenerateRequest: ``prompt`` is text, token ids, or chat messages
    (``[{"role": ..., "content": ...}]``); ``sampling`` holds SamplingParams fields. An empty
    ``request_id`` gets a fresh one (a resumed stream is tied to its original by it)."""
    req = pb.GenerateRequest(model=model, request_id=request_id or f"sdk-{uuid.uuid4().hex}")
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)  # type: ignore[arg-type]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    req.sampling.CopyFrom(pb.SamplingParams(**sampling))
    return req


_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


class _Recorder:
    def __init__(self) -> None:
        self.result = Result()
        self._start = time.perf_counter()
        self._last: float | None = None

    def chunk(self, c: pb.TokenChunk) -> Chunk:
        now = time.perf_counter()
        if self._last is None:
            self.result.ttft_s = now - self._start
        else:
            self.result.itl_s.append(now - self._last)
        self._last = now
        r = self.result
        r.token_ids.extend(c.token_ids)
        r.text += c.text
        r.logprobs.extend(c.logprobs)
        return Chunk(tuple(c.token_ids), c.text, tuple(c.logprobs))

    def summary(self, s: pb.Summary) -> None:
        r = self.result
        r.finish_reason = _FINISH.get(s.finish_reason)
        r.usage = {
            "prompt_tokens": s.usage.prompt_tokens,
            "completion_tokens": s.usage.completion_tokens,
            "cached_tokens": s.usage.cached_tokens,
        }
        # every field, zeros included (ListFields would drop them)
        r.server_timing = {f.name: getattr(s.timing, f.name) for f in s.timing.DESCRIPTOR.fields}
        r.request_id = s.request_id


def resumable(req: pb.GenerateRequest) -> bool:
    """Greedy or seeded: the server can reproduce the stream, so it can be resumed."""
    s = req.sampling
    return s.HasField("seed") or (s.HasField("temperature") and s.temperature == 0)


_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _retry_after_s(e: grpc.RpcError) -> float | None:
    for key, value in e.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "retry-after-ms":
            try:
                return int(value) / 1000
            except ValueError:
                return None
    return None


class _Call:
    """One generation across its attempts: what to send next, how long to wait after a
    failure, and the result so far. Shared by both clients (only the waiting differs)."""

    def __init__(
        self, req: pb.GenerateRequest, timeout: float | None, retries: int, backoff_s: float
    ) -> None:
        self.req, self.retries, self.backoff_s = req, retries, backoff_s
        self.rec = _Recorder()
        self.end = None if timeout is None else time.monotonic() + timeout
        self.attempt = 0

    def request(self) -> pb.GenerateRequest:
        have = len(self.rec.result.token_ids)
        if not have:
            return self.req
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.req)
        resumed.resume_from = self.req.resume_from + have
        return resumed

    def timeout(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def message(self, msg: pb.GenerateResponse) -> Chunk | None:
        if msg.WhichOneof("kind") == "chunk":
            return self.rec.chunk(msg.chunk)
        self.rec.summary(msg.summary)
        return None

    def backoff(self, e: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt; re-raises ``e`` when there is none."""
        if e.code() not in _RETRYABLE or self.attempt >= self.retries:
            raise e
        resuming = bool(self.rec.result.token_ids)
        if resuming and not resumable(self.req):
            raise e  # a sampled stream cannot be reproduced: tokens would differ
        hint = _retry_after_s(e) if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        wait = hint if hint is not None else self.backoff_s * 2**self.attempt
        left = self.timeout()
        if left is not None and wait >= left:
            raise e  # the deadline would pass while waiting
        self.attempt += 1
        self.rec.result.resumes += resuming
        return wait


class Stream:
    """The chunks of one generation as they arrive (iterate it: ``for`` on ``Client``,
    ``async for`` on ``AsyncClient``); ``result`` accumulates them, and after the last one
    holds the server's summary and the client-side TTFT/ITL."""

    def __init__(self, chunks: Any, result: Result) -> None:
        self._chunks = chunks
        self.result = result

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self._chunks)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks.__aiter__()


def _credentials(
    tls: bool, root_certificates: bytes | str | None
) -> grpc.ChannelCredentials | None:
    if not tls and root_certificates is None:
        return None
    roots = root_certificates
    if isinstance(roots, str):
        with open(roots, "rb") as f:
            roots = f.read()
    return grpc.ssl_channel_credentials(root_certificates=roots)


class _Base:
    """Args: target ``host:port``; token: bearer token; tls / root_certificates: TLS channel;
    retries / backoff_s: see the module docstring."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        _aio: bool = False,
    ) -> None:
        mod: Any = grpc.aio if _aio else grpc
        creds = _credentials(tls, root_certificates)
        self._channel = (
            mod.insecure_channel(target) if creds is None else mod.secure_channel(target, creds)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.retries, self.backoff_s = retries, backoff_s

    def _call(self, prompt: Prompt, timeout: float | None, kw: dict[str, Any]) -> _Call:
        return _Call(request(prompt, **kw), timeout, self.retries, self.backoff_s)


def _status_name(resp: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class Client(_Base):
    """Blocking client (see ``_Base`` for the arguments)."""

    def __init__(self, target: str, **kw: Any) -> None:
        super().__init__(target, **kw)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _run(self, call: _Call) -> Iterator[Chunk]:
        while True:
            try:
                stream = self._stub.Generate(
                    call.request(), timeout=call.timeout(), metadata=self._md
                )
                for msg in stream:
                    if (chunk := call.message(msg)) is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                time.sleep(call.backoff(e))

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kw: Any) -> Stream:
        """Stream the chunks of one generation (see ``request`` for the arguments); the
        stream's ``result`` fills in as chunks arrive."""
        call = self._call(prompt, timeout, kw)
        return Stream(self._run(call), call.rec.result)

    def complete(self, prompt: Prompt, *, timeout: float | None = None, **kw: Any) -> Result:
        """The whole generation, with the server's summary and client-side TTFT/ITL."""
        call = self._call(prompt, timeout, kw)
        for _ in self._run(call):
            pass
        return call.rec.result

    def tokenize(self, prompt: str | Sequence[dict[str, str]], *, model: str = "") -> list[int]:
        """Token ids of text, or of chat messages through the model's chat template."""
        resp = self._stub.Tokenize(_tokenize_request(prompt, model), metadata=self._md)
        return list(resp.token_ids)

    def models(self) -> list[str]:
        return [
            m.id for m in self._stub.ListModels(pb.ListModelsRequest(), metadata=self._md).models
        ]

    def health(self, service: str = "", *, timeout: float | None = 10.0) -> str:
        """The server's health status name ("SERVING" when it takes requests)."""
        req = health_pb2.HealthCheckRequest(service=service)
        return _status_name(self._health.Check(req, timeout=timeout))


class AsyncClient(_Base):
    """asyncio client with the same surface as ``Client`` (``generate`` is an async iterator)."""

    def __init__(self, target: str, **kw: Any) -> None:
        super().__init__(target, _aio=True, **kw)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _run(self, call: _Call) -> AsyncIterator[Chunk]:
        while True:
            try:
                stream = self._stub.Generate(
                    call.request(), timeout=call.timeout(), metadata=self._md
                )
                async for msg in stream:
                    if (chunk := call.message(msg)) is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                await asyncio.sleep(call.backoff(e))

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kw: Any) -> Stream:
        """An async-iterable ``Stream`` of the chunks (``async for chunk in ...``)."""
        call = self._call(prompt, timeout, kw)
        return Stream(self._run(call), call.rec.result)

    async def complete(self, prompt: Prompt, *, timeout: float | None = None, **kw: Any) -> Result:
        call = self._call(prompt, timeout, kw)
        async for _ in self._run(call):
            pass
        return call.rec.result

    async def tokenize(
        self, prompt: str | Sequence[dict[str, str]], *, model: str = ""
    ) -> list[int]:
        resp = await self._stub.Tokenize(_tokenize_request(prompt, model), metadata=self._md)
        return list(resp.token_ids)

    async def models(self) -> list[str]:
        resp = await self._stub.ListModels(pb.ListModelsRequest(), metadata=self._md)
        return [m.id for m in resp.models]

    async def health(self, service: str = "", *, timeout: float | None = 10.0) -> str:
        req = health_pb2.HealthCheckRequest(service=service)
        return _status_name(await self._health.Check(req, timeout=timeout))


def _tokenize_request(prompt: str | Sequence[dict[str, str]], model: str) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest(model=model)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
    return req
