"""Structured output: ``response_format`` (JSON object, JSON schema) as a token mask per step.

The grammar engine is llguidance (Microsoft's, Rust, on PyPI with no dependencies). Chosen
over xgrammar and outlines-core because it compiles a JSON schema lazily (no per-schema
precompile over the vocabulary: a new schema costs about a millisecond, so one bad or huge
schema cannot stall the engine thread), computes a 49k-token mask in about 0.2 ms on this
CPU, reads the tokenizer straight from ``tokenizer.json`` (the ``tokenizers`` object pdserve
already holds, GGUF-built ones included; no transformers at run time), and covers more of
JSON Schema (``$ref``, ``anyOf``, formats, patterns) than outlines-core.

Invariants:
- A request's matcher state is a function of its output tokens only: it is made on first use
  by replaying ``token_ids[num_prompt:]``. So it survives preemption (tokens are kept), a P/D
  handoff (the decode side replays the prefill side's first token) and a resumed request
  (replayed from the start); prefix caching is untouched (a mask changes sampling, not KV).
- The mask is exact with the tokenizer: llguidance reads each token's bytes from the same
  ``tokenizer.json`` (tested against ``Tokenizer.token_bytes`` over the whole vocabulary).
- Speculation does not draft for a guided request (services.engine.scheduler).
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from services.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from services.engine.request import Request
    from services.engine.tokenizer import Tokenizer

MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text
_CACHE = 64  # compiled grammars kept per engine (by schema text)


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the output must be. ``schema`` is the JSON text of a JSON Schema (``json_schema``;
    ``json_object`` means any JSON object)."""

    type: Literal["json_object", "json_schema"]
    schema: str | None = None

    @classmethod
    def from_openai(cls, body: object, field: str = "response_format") -> ResponseFormat | None:
        """OpenAI's ``response_format`` object; None for ``{"type": "text"}``. Raises
        InvalidRequestError naming the bad part."""
        if not isinstance(body, dict):
            raise InvalidRequestError(field, "must be an object with a type")
        kind = body.get("type")
        extra = set(body) - {"type", "json_schema"}
        if extra:
            raise InvalidRequestError(f"{field}.{sorted(extra)[0]}", "unknown field")
        if kind == "text" or kind == "json_object":
            if "json_schema" in body:
                raise InvalidRequestError(f"{field}.json_schema", f"not allowed with type {kind}")
            return None if kind == "text" else cls("json_object")
        if kind != "json_schema":
            raise InvalidRequestError(
                f"{field}.type", f"must be text, json_object or json_schema, got {kind!r}"
            )
        spec = body.get("json_schema")
        where = f"{field}.json_schema"
        if not isinstance(spec, dict):
            raise InvalidRequestError(where, "must be an object with name and schema")
        extra = set(spec) - {"name", "schema", "strict", "description"}
        if extra:
            raise InvalidRequestError(f"{where}.{sorted(extra)[0]}", "unknown field")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InvalidRequestError(f"{where}.name", "must be a non-empty string")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{where}.schema", "must be a JSON Schema object")
        if spec.get("strict") not in (None, True, False):
            raise InvalidRequestError(f"{where}.strict", "must be a boolean")
        # NOTE: the output always follows the schema, strict or not (OpenAI's strict mode
        # is the stronger promise; pdserve keeps it either way)
        # NOTE: keys keep their order: the properties' order is the output's
        fmt = cls("json_schema", json.dumps(schema, separators=(",", ":")))
        fmt.check(f"{where}.schema")
        return fmt

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form)."""
        import llguidance

        schema = self.schema if self.type == "json_schema" else '{"type":"object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema)  # type: ignore[arg-type]

    def check(self, field: str = "response_format") -> None:
        """Raise InvalidRequestError if the schema is too long or does not compile."""
        if self.type not in ("json_object", "json_schema") or (
            (self.type == "json_schema") != isinstance(self.schema, str)
        ):
            raise InvalidRequestError(field, "must be json_object, or json_schema with a schema")
        if self.schema is not None and len(self.schema) > MAX_SCHEMA_CHARS:
            raise InvalidRequestError(field, f"is over {MAX_SCHEMA_CHARS} characters")
        error = _compile_error(self)
        if error:
            raise InvalidRequestError(field, f"is not a schema pdserve can follow: {error}")


@functools.lru_cache(maxsize=256)
def _compile_error(fmt: ResponseFormat) -> str:
    """'' when the format's grammar compiles; why not otherwise. Cached: the gateway, the
    params and the engine each check the same format."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(fmt.grammar())
    except ValueError as e:
        return str(e)


class Grammars:
    """The engine's matchers, one per guided request, and the masks they give.

    Built on first use: a model without a tokenizer refuses ``response_format`` by name."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)
        self._lltok: Any = None
        self._compiled: OrderedDict[ResponseFormat, str] = OrderedDict()
        self._matchers: dict[str, tuple[Any, int]] = {}  # request id -> (matcher, consumed)

    def check(self, fmt: ResponseFormat) -> None:
        """Raise InvalidRequestError (field ``response_format``) if it cannot be followed here."""
        if self._tokenizer is None:
            raise InvalidRequestError("response_format", "needs a tokenizer; this model has none")
        self._grammar(fmt)

    def allowed(self, req: Request) -> torch.Tensor:
        """Bool [vocab]: the tokens the request's grammar allows next (EOS where it may end)."""
        matcher = self._sync(req)
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        # NOTE: llguidance's mask is 32-bit words, bit i of word w = token 32 w + i; on a
        # little-endian host that is byte order, then bit order within a byte
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].view(bool))

    def advance(self, req: Request) -> str | None:
        """Feed the request's new tokens to its matcher. Returns None, ``"complete"`` when the
        grammar can take no more (the output is whole), or the error that broke it."""
        matcher = self._sync(req)
        if matcher.is_error():
            return f"the grammar refused the output: {matcher.get_error()}"
        return "complete" if matcher.is_stopped() else None

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def _sync(self, req: Request) -> Any:
        import llguidance

        assert req.params.response_format is not None
        entry = self._matchers.get(req.request_id)
        if entry is None:
            grammar = self._grammar(req.params.response_format)
            entry = (llguidance.LLMatcher(self._tokenizer_ll(), grammar, log_level=0), 0)
        matcher, consumed = entry
        # NOTE: an EOS the grammar allowed stops it (llguidance's EndOfSentence), not an error
        new = req.token_ids[req.num_prompt + consumed :]
        if new:
            matcher.consume_tokens(new)
        self._matchers[req.request_id] = (matcher, req.num_tokens - req.num_prompt)
        return matcher

    def _tokenizer_ll(self) -> Any:
        import llguidance

        if self._lltok is None:
            assert self._tokenizer is not None
            self._lltok = llguidance.LLTokenizer(
                self._tokenizer.to_json(), n_vocab=self._vocab, eos_token=self._eos
            )
        return self._lltok

    def _grammar(self, fmt: ResponseFormat) -> str:
        grammar = self._compiled.get(fmt)
        if grammar is None:
            fmt.check()
            grammar = fmt.grammar()
            self._compiled[fmt] = grammar
            if len(self._compiled) > _CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(fmt)
        return grammar
