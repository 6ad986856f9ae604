"""Types and pure functions of the prefill/decode flow, shared by gateway and replicas."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.sampling_params import SamplingParams


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
    kv_address: str | None  # transport address of the replica holding the KV (None if finished)
    queue_s: float
    prefill_s: float


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens streamed by a decode replica."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    num_cached_tokens: int = 0
    kv_transfer_s: float = 0.0  # on the first chunk after a KV pull


def prefill_on_decode(
    mode: str, num_prompt_tokens: int, num_cached_tokens: int, threshold: int
) -> bool:
    """Conditional disaggregation: short uncached prompts skip the prefill pool, because moving
    their KV would cost more than computing it where it will be decoded."""
    if mode == "colocated":
        return True
    return threshold > 0 and num_prompt_tokens - num_cached_tokens < threshold


class KVTransferFailedError(RuntimeError):
    """A KV pull failed or timed out; the gateway re-prefills once, then answers 503."""
