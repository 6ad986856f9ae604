"""Per-request sampling parameters, validated before the engine takes any KV block."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engine.grammar import ResponseFormat

MIN_TEMPERATURE = 1e-5  # below it (and above 0), logits / temperature can overflow fp32
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 256
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
MAX_LOGIT_BIAS = 300  # biased tokens per request (OpenAI's limit)
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty|, OpenAI's range
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes sampling reproducible: the token at output index i is drawn from a generator
    seeded by (seed, i), so the same seed gives the same text on any engine, batch or replica.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    # with logprobs: this many most likely tokens (and their log-probabilities) per position
    top_logprobs: int = 0
    # no EOS / stop token is drawn, and no stop ends the output, before this many tokens
    min_tokens: int = 0
    # (token id, bias in [-100, 100]) added to the logits before sampling, as OpenAI's
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's: subtracted from the logit of each token the output holds (once / per
    # occurrence); vLLM's: a token of the prompt or the output has its logit divided by it
    # when positive, multiplied when negative (1 = off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's: each prompt token's log-probability given the tokens before it (and this many
    # alternatives per position); None = off. Such a request does not read the prefix cache
    # (cached positions have no logits) until its prompt is scored.
    prompt_logprobs: int | None = None
    # the output follows this grammar (services.engine.grammar); None = free text
    response_format: ResponseFormat | None = None
    # NOTE: not a sampling setting, but it travels wherever the request does (prefill,
    # decode, re-prefill, resume): it scopes prefix-cache reuse (services.engine.block_hash)
    cache_salt: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens so far (any penalty is on)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        from services.engine.errors import InvalidRequestError

        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise InvalidRequestError(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature", f"must be a number >= 0, got {self.temperature!r}"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(
                "temperature",
                f"{self.temperature!r} is too small to sample (logits / temperature overflow); "
                f"use 0 for greedy, or at least {MIN_TEMPERATURE}",
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(
                "top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(
                "stop", f"must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        # NOTE: every stop string is checked after every token on the engine thread: caps keep
        # one request from slowing the whole batch (40,000 stop strings cost 0.56 s a token)
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError(
                "stop", f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each"
            )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(
                "stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}"
            )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str)
            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise InvalidRequestError(
                "cache_salt",
                f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            )
        if (
            isinstance(self.top_logprobs, bool)
            or not isinstance(self.top_logprobs, int)
            or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequestError(
                "top_logprobs",
                f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}",
            )
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequestError(
                "prompt_logprobs",
                f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs")
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise InvalidRequestError(
                "min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            and _is_number(b) and -100 <= b <= 100
            for t, b in self.logit_bias
        ):  # fmt: skip
            raise InvalidRequestError(
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS} token ids, each with a bias in [-100, 100]",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(
                    name, f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}"
                )
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                "repetition_penalty",
                f"must be a number in (0, {MAX_REPETITION_PENALTY}] (1 = off), got {rp!r}",
            )
        if self.response_format is not None:
            if not isinstance(self.response_format, ResponseFormat):
                raise InvalidRequestError("response_format", "must be a ResponseFormat")
            self.response_format.check()
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )

    @classmethod
    def create(
        cls, stop: object = None, stop_token_ids: object = None, **kwargs: object
    ) -> SamplingParams:
        """Build and validate from loose edge values (``stop`` may be a str or a list of str)."""
        from services.engine.errors import InvalidRequestError

        if stop is None:
            stop_t: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stop_t = (stop,)
        elif isinstance(stop, list | tuple):
            stop_t = tuple(stop)  # type: ignore[arg-type]
        else:
            raise InvalidRequestError(
                "stop", f"must be a string or a list of strings, got {type(stop).__name__}"
            )
        if stop_token_ids is None:
            ids_t: tuple[int, ...] = ()
        elif isinstance(stop_token_ids, list | tuple):
            ids_t = tuple(stop_token_ids)  # type: ignore[arg-type]
        else:
            raise InvalidRequestError("stop_token_ids", "must be a list of token ids")
        params = cls(stop=stop_t, stop_token_ids=ids_t, **kwargs)  # type: ignore[arg-type]
        params.validate()
        return params


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_prompt(
    prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """The prompt checks shared by the engine and the gateway; raises InvalidRequestError."""
    from services.engine.errors import InvalidRequestError

    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt
    ):
        raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab_size})")
    if any(t >= vocab_size for t, _ in params.logit_bias):
        raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(prompt)} tokens; the model's context is {max_model_len} tokens"
        )
    if len(prompt) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens",
        )
