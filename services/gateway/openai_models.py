"""OpenAI-compatible request bodies (pydantic, at the edge) and their translation to
``SamplingParams``. Pure: no I/O, unit-testable alone.

No field is silently ignored. A field of OpenAI's (or vLLM's) request bodies that pdserve does
not implement is listed in ``UNSUPPORTED`` (the README shows the list) and refused with a 400
naming it, unless it carries its neutral value (null, false, 0, an empty string, list or
object: it asks for nothing, and clients that fill in defaults send it). Any other field is
refused as unknown.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.engine.errors import InvalidRequestError
from services.engine.grammar import ResponseFormat
from services.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(
        False,
        description="a last event with `usage` (and `pdserve_timing`) and empty `choices`",
    )
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's: with include_usage, every event also carries `usage` so far",
    )


MAX_CHOICES = 64  # choices in one response (prompts x n)

_SAMPLING_UNSUPPORTED = frozenset(
    {
        "best_of",
        "function_call",
        "functions",
        "metadata",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "reasoning_effort",
        "service_tier",
        "store",
        "suffix",
        "tool_choice",
        "tools",
        "user",
        "web_search_options",
        "audio",
    }
)

# body kind -> fields pdserve does not implement (refused by name unless neutral)
UNSUPPORTED: dict[str, frozenset[str]] = {
    "sampling": _SAMPLING_UNSUPPORTED,
    # vLLM's chat echo (prepend the last message) is not implemented; completions' is
    "chat": frozenset({"echo"}) | _SAMPLING_UNSUPPORTED,
    "tokenize": frozenset(
        {"continue_final_message", "chat_template", "chat_template_kwargs", "tools"}
    ),
    "message": frozenset(
        {"name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"}
    ),
}


def _neutral(value: object) -> bool:
    return value is None or value is False or value in (0, "", [], {})


def check_fields(model: type[BaseModel], body: dict[str, Any], kind: str, where: str = "") -> None:
    """Raise InvalidRequestError for the first field of ``body`` that ``model`` lacks: as not
    implemented (listed in UNSUPPORTED[kind], non-neutral) or unknown; neutral unsupported
    fields are dropped from ``body``."""
    for key in list(body):
        if key in model.model_fields:
            continue
        field = f"{where}{key}"
        if key in UNSUPPORTED[kind]:
            if _neutral(body[key]):
                del body[key]
                continue
            raise InvalidRequestError(field, "is not implemented by pdserve")
        raise InvalidRequestError(field, "unknown field")


class _Sampling(BaseModel):
    # NOTE: no field is ignored (check_fields runs first; forbid is the backstop), and known
    # fields are strictly typed: a wrong type is a 400 naming the field.
    model_config = ConfigDict(extra="forbid", strict=False)

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
    n: int = Field(
        1, ge=1, le=16, description="choices per prompt (each its own sample; seed + i with a seed)"
    )
    min_tokens: int = Field(0, ge=0, description="no EOS / stop before this many tokens")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string, OpenAI's) -> bias in [-100, 100]"
    )
    presence_penalty: float = Field(
        0.0, description="subtracted once from each token the output already holds, [-2, 2]"
    )
    frequency_penalty: float = Field(
        0.0, description="subtracted per occurrence in the output so far, [-2, 2]"
    )
    repetition_penalty: float = Field(
        1.0,
        description="extension (vLLM's): a token of the prompt or output has its logit divided "
        "by it when positive, multiplied when negative; 1 = off",
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", '
        '"schema", "strict"}}: the output follows it (services.engine.grammar)',
    )
    cache_salt: str | None = Field(
        None,
        description="as vLLM's: requests with different salts never share prefix-cache blocks "
        "(and cached_tokens says nothing across them); one per tenant",
    )

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InvalidRequestError("logit_bias", f"keys are token ids, got {key!r}")
            out.append((int(key), float(bias)))
        return tuple(sorted(out))

    @property
    def usage_events(self) -> Literal["final", "continuous"] | None:
        """Which stream events carry ``usage``: the last only, every one too, or none."""
        if self.stream_options is None or not self.stream_options.include_usage:
            return None
        return "continuous" if self.stream_options.continuous_usage_stats else "final"

    def sampling_params(
        self, default_max_tokens: int, logprobs: bool, top_logprobs: int = 0
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "only allowed when stream is true")
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
            top_logprobs=top_logprobs,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            response_format=(
                None
                if self.response_format is None
                else ResponseFormat.from_openai(self.response_format)
            ),
            cache_salt=self.cache_salt,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids, or a list of either (a batch: n choices for each)"
    )

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        if len(p) * self.n > MAX_CHOICES:
            raise InvalidRequestError(
                "prompt", f"{len(p)} prompts x n {self.n} is over {MAX_CHOICES} choices"
            )
        return list(p)  # type: ignore[arg-type]

    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="the chosen tokens' log-probabilities and this many alternatives per "
        "position (0: none)",
    )

    echo: bool = Field(
        False,
        description="the prompt before the completion, in the text and (with logprobs) in the "
        "logprobs, its first token scored None",
    )

    def params(self, default_max_tokens: int) -> SamplingParams:
        n = self.logprobs
        params = self.sampling_params(default_max_tokens, n is not None, n or 0)
        if self.echo and n is not None:
            return replace(params, prompt_logprobs=n)
        return params


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = Field(description="only text parts: pdserve serves text models")
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] = Field(
        description="text, or an array of text parts (joined in order, as OpenAI's)"
    )

    @field_validator("content")
    @classmethod
    def _join_parts(cls, v: str | list[TextPart]) -> str:
        return v if isinstance(v, str) else "".join(p.text for p in v)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="alternatives per position (needs logprobs: true)"
    )

    def params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        return self.sampling_params(default_max_tokens, self.logprobs, self.top_logprobs or 0)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages as the chat endpoint renders them
    (with the generation prompt)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = Field(True, description="a prompt's BOS, where the model adds one")
    add_generation_prompt: Literal[True] = Field(
        True, description="the chat endpoint always adds it; false is refused"
    )
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


_KIND: dict[type[BaseModel], str] = {
    TokenizeRequest: "tokenize",
    DetokenizeRequest: "tokenize",
    ChatCompletionRequest: "chat",
}


def parse(model: type[BaseModel], body: object) -> Any:
    """Validate a decoded JSON body; raises InvalidRequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    body = dict(body)
    check_fields(model, body, _KIND.get(model, "sampling"))
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = [dict(m) if isinstance(m, dict) else m for m in messages]
        for i, m in enumerate(body["messages"]):
            if isinstance(m, dict):
                check_fields(ChatMessageIn, m, "message", f"messages.{i}.")
                _check_parts(m.get("content"), f"messages.{i}.content")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # NOTE: pydantic puts union branch tags ("str", "list[int]") into the location; the
        # client named the field, not the branch.
        parts = [str(x) for x in err["loc"] if not _is_union_tag(x)]
        field = ".".join(parts) or "body"
        raise InvalidRequestError(field, err["msg"]) from None


def _check_parts(content: object, where: str) -> None:
    """A non-text content part is refused by name (a text model cannot read it)."""
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is not None and kind != "text":
            raise InvalidRequestError(
                f"{where}.{j}.type", f"{kind!r} parts are not implemented: pdserve serves text"
            )


def _is_union_tag(x: object) -> bool:
    return isinstance(x, str) and (x in {"str", "int", "float", "bool", "none"} or "[" in x)
