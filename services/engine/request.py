"""Per-request state inside one engine, and what the engine streams back for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.engine.block_hash import BlockHash
from services.engine.kv_handle import KVHandle
from services.engine.kv_stream import KVSink
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill-only: first token sampled, KV ready for handoff
    ERROR = "error"  # failed alone (RequestOutput.error says why); never a success


@dataclass(slots=True)
class Timings:
    """Monotonic seconds (time.perf_counter) of a request's milestones inside one engine."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    itls: list[float] = field(default_factory=list)  # each inter-token gap

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_s(self) -> float | None:
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True)
class Request:
    """Mutable state of one request. ``token_ids`` = prompt + generated; the engine computes
    KV for ``token_ids[:num_computed]`` and samples when ``num_computed == len(token_ids)``."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    prefill_only: bool = False
    kv_import: KVHandle | None = None
    kv_sink: KVSink | None = None  # a prefill-only request's KV handoff (its hooks)
    stream_next: int = 0  # positions [0, stream_next) of every layer are in the sink
    error: str | None = None  # why it ended with FinishReason.ERROR
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on first admission
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    # parallel to logprobs when params.top_logprobs: each position's most likely tokens
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # with params.prompt_logprobs: entry i scores prompt token i + 1 (its log-probability and
    # alternatives); filled as prefill chunks compute, sent once with the first token
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    timings: Timings = field(default_factory=Timings)
    num_preemptions: int = 0
    # stream cursors: what the caller has already been given
    sent_tokens: int = 0
    sent_text: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One streamed update: the tokens and text new since the previous update of this request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # timings, seconds (None until known)
    queue_s: float | None
    prefill_s: float | None
    ttft_s: float | None
    itls: list[float] | None  # all gaps, on the final update only
    error: str | None = None  # with FinishReason.ERROR: what failed
    # with params.top_logprobs: each new token's most likely tokens, (token, logprob) pairs
    new_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    # with params.prompt_logprobs, on the update that carries the first token (of the engine
    # that computed the prompt): entry i scores prompt token i + 1
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
