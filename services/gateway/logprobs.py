"""OpenAI's logprobs shapes, from the engine's per-token log-probabilities and alternatives.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}``
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``; ``text_offset`` counts characters from the start of the completion.

A token's ``token`` is its bytes decoded as UTF-8 (a piece of a character shows as U+FFFD;
``bytes`` has the exact bytes). Log-probabilities are of the model's distribution before
temperature and filters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.engine.tokenizer import Tokenizer

Alternatives = Sequence[tuple[int, float]]


def _text(tok: Tokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tok.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat(
    tok: Tokenizer,
    ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Alternatives] | None,
) -> dict[str, Any]:
    content = []
    for i, (token_id, lp) in enumerate(zip(ids, logprobs, strict=True)):
        e = _entry(tok, token_id, lp)
        e["top_logprobs"] = [_entry(tok, t, v) for t, v in (top[i] if top else ())]
        content.append(e)
    return {"content": content, "refusal": None}


def completion(
    tok: Tokenizer,
    ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Alternatives] | None,
    offset: int = 0,
) -> tuple[dict[str, Any], int]:
    """The completions shape for these tokens, their text starting at character ``offset``;
    returns it and the offset after them (a stream's next chunk starts there)."""
    tokens, offsets = [], []
    for token_id in ids:
        text = _text(tok, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    alts = None
    if top is not None:
        alts = [{_text(tok, t): v for t, v in pairs} for pairs in top]
    body = {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": alts,
        "text_offset": offsets,
    }
    return body, offset
