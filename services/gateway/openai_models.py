"""OpenAI-compatible request bodies (pydantic, at the edge) and their translation to
``SamplingParams``. Pure: no I/O, unit-testable alone."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(
        False,
        description="a last event with `usage` (and `pdserve_timing`) and empty `choices`",
    )


class _Sampling(BaseModel):
    # NOTE: unknown fields are ignored (clients send many optional ones), but known fields are
    # strictly typed: a wrong type is a 400 naming the field.
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str = Field(description="model id from /v1/models")
    max_tokens: int | None = Field(None, description="tokens to generate at most")
    temperature: float = Field(1.0, description="0 = greedy")
    top_p: float = 1.0
    top_k: int = Field(0, description="extension: 0 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="extension")
    ignore_eos: bool = Field(False, description="extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="only 1 is supported")
    cache_salt: str | None = Field(
        None,
        description="as vLLM's: requests with different salts never share prefix-cache blocks "
        "(and cached_tokens says nothing across them); one per tenant",
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, default_max_tokens: int, logprobs: bool) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "only allowed when stream is true")
        if self.n != 1:
            raise InvalidRequestError("n", "only n=1 is supported")
        return SamplingParams.create(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(description="text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=1, description="1 = logprob of each chosen token")


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False


def parse(model: type[_Sampling], body: object) -> _Sampling:
    """Validate a decoded JSON body; raises InvalidRequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # NOTE: pydantic puts union branch tags ("str", "list[int]") into the location; the
        # client named the field, not the branch.
        parts = [str(x) for x in err["loc"] if not _is_union_tag(x)]
        field = ".".join(parts) or "body"
        raise InvalidRequestError(field, err["msg"]) from None


def _is_union_tag(x: object) -> bool:
    return isinstance(x, str) and (x in {"str", "int", "float", "bool", "none"} or "[" in x)
