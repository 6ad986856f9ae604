"""Types and pure functions of the prefill/decode flow, shared by gateway and replicas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtransfer.base import KVRef, KVTransferFailedError
from services.engine.block_hash import BlockHash
from services.engine.sampling_params import SamplingParams

__all__ = [
    "GenerateSpec",
    "KVRef",
    "KVTransferFailedError",
    "PrefillResult",
    "RouteHint",
    "TokenChunk",
    "prefill_on_decode",
    "prompt_logprobs_of",
]


PromptLogprobs = tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A validated, tokenized request as the gateway hands it to replicas."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill replica returns: the first token and where its KV can be pulled."""

    request_id: str
    first_token: int
    first_text: str
    first_logprob: float | None
    finish_reason: str | None  # set when the first token already ended the request
    kv: KVRef | None  # where the KV is held (None: the first token ended the request)
    queue_s: float
    prefill_s: float
    num_cached_tokens: int = 0  # prompt tokens served from this replica's prefix cache
    first_top_logprobs: tuple[tuple[int, float], ...] | None = None  # with top_logprobs
    # with prompt_logprobs: entry i scores prompt token i + 1 (logprob, alternatives)
    prompt_logprobs: PromptLogprobs = None


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens streamed by a decode replica."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    num_cached_tokens: int = 0
    kv_transfer_s: float = 0.0  # on the first chunk after a KV pull
    kv_transfer_bytes: int = 0  # likewise
    # with top_logprobs: per token, its most likely tokens as (token, logprob) pairs
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # with prompt_logprobs, on the first chunk of the replica that computed the prompt
    prompt_logprobs: PromptLogprobs = None


def prompt_logprobs_of(
    scores: Sequence[tuple[float, tuple[tuple[int, float], ...]]] | None,
) -> PromptLogprobs:
    """An engine output's prompt scores as the flow carries them (immutable)."""
    return None if scores is None else tuple(scores)


def prefill_on_decode(
    mode: str, num_prompt_tokens: int, num_cached_tokens: int, threshold: int
) -> bool:
    """Conditional disaggregation: short uncached prompts skip the prefill pool, because moving
    their KV would cost more than computing it where it will be decoded."""
    if mode == "colocated":
        return True
    return threshold > 0 and num_prompt_tokens - num_cached_tokens < threshold


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the gateway tells the request router about a call (the ``route`` keyword of
    ``handoff`` / ``generate``; see ``services.router``). Replicas ignore it."""

    prompt_tokens: int
    # index replica id -> prompt tokens that replica holds in its prefix cache
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    computes_prompt: bool = True  # False: the KV arrives from a prefill replica
    kv_blocks: int = 0  # blocks the request needs on the replica
    prefix_aware: bool = True  # False: least-loaded routing (the baseline)
    # the prompt's block hash chain (what the gateway looked up) and the block size: the
    # router remembers where it sent them until the index has caught up
    block_hashes: tuple[BlockHash, ...] = ()
    block_size: int = 0
