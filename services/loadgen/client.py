"""Sends a workload to an OpenAI-compatible endpoint and times every request at the client.

Arrivals are open-loop (Poisson at a rate: conversations start on a seeded schedule whatever
the server does, as users would) or closed-loop (a fixed number of clients, each sending its
next conversation when the last ends). Every request streams; a request's TTFT is from its send
to its first content event, its ITLs the gaps between content events (a gap over k tokens
counts k times gap / k), its output tokens those the server's ``usage`` reports.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from services.loadgen.workload import Conversation, Turn


@dataclass(frozen=True, slots=True)
class Arrivals:
    """``rate`` conversations/s (Poisson, open loop) or ``concurrency`` clients (closed loop)."""

    rate: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give a rate or a concurrency, not both")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def offsets(self, n: int) -> list[float]:
        """Open loop: each conversation's start, seconds after the first (exponential gaps)."""
        assert self.rate is not None
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out

    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate is not None else f"{self.concurrency} clients"


@dataclass(slots=True)
class Record:
    """One request as the client saw it (seconds)."""

    conversation: int
    turn: int
    start_s: float  # since the run began
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None
    server: dict[str, Any] | None = None  # the server's own timing (pdserve_timing), if sent

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the server's base URL, without /v1
    model: str
    chat: bool = False  # /v1/chat/completions, else /v1/completions
    api_key: str | None = None
    ignore_eos: bool = True  # exact output lengths (vLLM's and pdserve's extension)
    temperature: float = 0.0
    timeout_s: float = 600.0

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")


def _body(target: Target, conv: Conversation, turn: int, answers: list[str]) -> dict[str, Any]:
    t: Turn = conv.turns[turn]
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": t.max_tokens,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.chat:
        msgs = [{"role": "system", "content": conv.system}] if conv.system else []
        for i in range(turn):
            msgs += [
                {"role": "user", "content": conv.turns[i].text},
                {"role": "assistant", "content": answers[i]},
            ]
        body["messages"] = [*msgs, {"role": "user", "content": t.text}]
    else:
        parts = [conv.system] if conv.system else []
        for i in range(turn):
            parts += [conv.turns[i].text, answers[i]]
        body["prompt"] = "\n".join([*parts, t.text])
    return body


async def _one(
    client: httpx.AsyncClient, target: Target, body: dict[str, Any], rec: Record, t0: float
) -> str:
    """Send one request, filling ``rec``; returns the answer's text."""
    text: list[str] = []
    sent = time.perf_counter()
    rec.start_s = sent - t0
    last = None
    try:
        async with client.stream("POST", target.endpoint, json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {raw[:300]}"
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    rec.error = f"stream error: {ev['error'].get('message', ev['error'])}"
                    return "".join(text)
                now = time.perf_counter()
                if ev.get("usage"):
                    rec.prompt_tokens = ev["usage"].get("prompt_tokens")
                    rec.output_tokens = ev["usage"].get("completion_tokens") or rec.output_tokens
                if ev.get("pdserve_timing"):
                    rec.server = ev["pdserve_timing"]
                for c in ev.get("choices") or ():
                    piece = (c.get("delta") or {}).get("content") if target.chat else c.get("text")
                    k = len(c["token_ids"]) if "token_ids" in c else (1 if piece else 0)
                    if not k:
                        continue
                    text.append(piece or "")
                    if last is None:
                        rec.ttft_s = now - sent
                    else:
                        rec.itls.extend([(now - last) / k] * k)
                    last = now
        rec.e2e_s = time.perf_counter() - sent
        if rec.ttft_s is None:
            rec.error = "no token arrived"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return "".join(text)


async def run(
    target: Target,
    conversations: list[Conversation],
    arrivals: Arrivals,
    on_done: Callable[[Record], None] | None = None,
) -> tuple[list[Record], float]:
    """Every turn of every conversation; returns the records (in conversation, turn order)
    and the run's duration in seconds."""
    records: list[list[Record]] = [
        [Record(i, j, 0.0) for j in range(len(c.turns))] for i, c in enumerate(conversations)
    ]
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=target.timeout_s, headers=headers, limits=limits) as cl:
        t0 = time.perf_counter()

        async def converse(i: int) -> None:
            answers: list[str] = []
            for j in range(len(conversations[i].turns)):
                rec = records[i][j]
                answers.append(
                    await _one(cl, target, _body(target, conversations[i], j, answers), rec, t0)
                )
                if on_done is not None:
                    on_done(rec)
                if not rec.ok:  # the rest of the conversation depends on this answer
                    for later in records[i][j + 1 :]:
                        later.error = "an earlier turn failed"
                        if on_done is not None:
                            on_done(later)
                    return

        if arrivals.rate is not None:

            async def at(i: int, offset: float) -> None:
                # NOTE: open loop: the schedule, not the server, decides when each starts
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                await converse(i)

            offsets = arrivals.offsets(len(conversations))
            await asyncio.gather(*(at(i, o) for i, o in enumerate(offsets)))
        else:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(conversations)):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty():
                    await converse(queue.get_nowait())

            assert arrivals.concurrency is not None
            await asyncio.gather(*(worker() for _ in range(arrivals.concurrency)))
        duration = time.perf_counter() - t0
    return [r for conv in records for r in conv], duration
