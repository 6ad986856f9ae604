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


def prompt(
    tok: Tokenizer,
    ids: Sequence[int],
    scores: Sequence[tuple[float, Alternatives]] | None,
    with_top: bool,
) -> dict[str, Any]:
    """The completions shape for an echoed prompt: its first token has no score (None, as
    OpenAI's), each other token the score the engine gave it (``prompt_logprobs``).
    Raises ValueError when the scores do not cover the prompt."""
    scores = scores or ()
    if len(scores) != len(ids) - 1:
        raise ValueError(f"{len(scores)} prompt scores for a prompt of {len(ids)} tokens")
    body, _ = completion(
        tok,
        ids,
        [None, *(lp for lp, _ in scores)],  # type: ignore[list-item]
        [(), *(alts for _, alts in scores)] if with_top else None,
    )
    if with_top:
        body["top_logprobs"][0] = None
    return body


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """``first`` then ``second`` (completions shapes, their offsets already placed)."""
    top = None
    if first["top_logprobs"] is not None or second["top_logprobs"] is not None:
        top = [*(first["top_logprobs"] or ()), *(second["top_logprobs"] or ())]
    return {
        "tokens": [*first["tokens"], *second["tokens"]],
        "token_logprobs": [*first["token_logprobs"], *second["token_logprobs"]],
        "top_logprobs": top,
        "text_offset": [*first["text_offset"], *second["text_offset"]],
    }


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
