"""Python SDK of pdserve's gRPC API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from pdserve.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate("The capital of France is", max_tokens=8, temperature=0):
            print(chunk.text, end="")
        result = c.complete("Hello", max_tokens=16)   # .text, .token_ids, .ttft_s, .itl_s

Calls take a ``timeout`` (seconds; the gRPC deadline). A call that fails with UNAVAILABLE
before its first token is retried with exponential backoff (``retries`` times); after the
first token it is not (tokens would repeat). Client-side TTFT and inter-token gaps are
measured on every result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

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


def request(
    prompt: Prompt, *, model: str = "", request_id: str = "", **sampling: Any
) -> pb.GenerateRequest:
    """Build a GenerateRequest: ``prompt`` is text, token ids, or chat messages
    (``[{"role": ..., "content": ...}]``); ``sampling`` holds SamplingParams fields."""
    req = pb.GenerateRequest(model=model, request_id=request_id)
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


def _retryable(e: grpc.RpcError, got_tokens: bool) -> bool:
    return not got_tokens and e.code() == grpc.StatusCode.UNAVAILABLE


class Client:
    """Blocking client. Args: target ``host:port``; retries / backoff_s for UNAVAILABLE
    before the first token."""

    def __init__(self, target: str, *, retries: int = 3, backoff_s: float = 0.2) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self.retries, self.backoff_s = retries, backoff_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _run(
        self, req: pb.GenerateRequest, timeout: float | None, rec: _Recorder
    ) -> Iterator[Chunk]:
        for attempt in range(self.retries + 1):
            got = False
            try:
                for msg in self._stub.Generate(req, timeout=timeout):
                    if msg.WhichOneof("kind") == "chunk":
                        got = True
                        yield rec.chunk(msg.chunk)
                    else:
                        rec.summary(msg.summary)
                return
            except grpc.RpcError as e:
                if attempt == self.retries or not _retryable(e, got):
                    raise
                time.sleep(self.backoff_s * 2**attempt)

    def generate(
        self, prompt: Prompt, *, timeout: float | None = None, **kw: Any
    ) -> Iterator[Chunk]:
        """Stream the chunks of one generation (see ``request`` for the arguments)."""
        yield from self._run(request(prompt, **kw), timeout, _Recorder())

    def complete(self, prompt: Prompt, *, timeout: float | None = None, **kw: Any) -> Result:
        """The whole generation, with the server's summary and client-side TTFT/ITL."""
        rec = _Recorder()
        for _ in self._run(request(prompt, **kw), timeout, rec):
            pass
        return rec.result

    def tokenize(self, text: str, *, model: str = "") -> list[int]:
        return list(self._stub.Tokenize(pb.TokenizeRequest(model=model, text=text)).token_ids)

    def models(self) -> list[str]:
        return [m.id for m in self._stub.ListModels(pb.ListModelsRequest()).models]


class AsyncClient:
    """asyncio client with the same surface as ``Client`` (``generate`` is an async iterator)."""

    def __init__(self, target: str, *, retries: int = 3, backoff_s: float = 0.2) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self.retries, self.backoff_s = retries, backoff_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _run(
        self, req: pb.GenerateRequest, timeout: float | None, rec: _Recorder
    ) -> AsyncIterator[Chunk]:
        for attempt in range(self.retries + 1):
            got = False
            try:
                async for msg in self._stub.Generate(req, timeout=timeout):
                    if msg.WhichOneof("kind") == "chunk":
                        got = True
                        yield rec.chunk(msg.chunk)
                    else:
                        rec.summary(msg.summary)
                return
            except grpc.RpcError as e:
                if attempt == self.retries or not _retryable(e, got):
                    raise
                await asyncio.sleep(self.backoff_s * 2**attempt)

    async def generate(
        self, prompt: Prompt, *, timeout: float | None = None, **kw: Any
    ) -> AsyncIterator[Chunk]:
        async for c in self._run(request(prompt, **kw), timeout, _Recorder()):
            yield c

    async def complete(self, prompt: Prompt, *, timeout: float | None = None, **kw: Any) -> Result:
        rec = _Recorder()
        async for _ in self._run(request(prompt, **kw), timeout, rec):
            pass
        return rec.result

    async def tokenize(self, text: str, *, model: str = "") -> list[int]:
        resp = await self._stub.Tokenize(pb.TokenizeRequest(model=model, text=text))
        return list(resp.token_ids)

    async def models(self) -> list[str]:
        resp = await self._stub.ListModels(pb.ListModelsRequest())
        return [m.id for m in resp.models]
