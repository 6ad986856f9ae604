"""Token sampling: greedy, temperature, top-k, top-p, with per-request reproducible seeds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.sampling_params import SamplingParams

_MASK = 0x7FFF_FFFF_FFFF_FFFF
TopLogprobs = tuple[tuple[int, float], ...]
# a row's tokens so far (prompt, then output) and how many of them are the prompt
History = tuple[Sequence[int], int]


def position_seed(seed: int, index: int) -> int:
    # NOTE: a pure function of (seed, output index): the same token is drawn whichever engine,
    # batch or replica samples it, and after a preemption or a resume.
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 31
    return x & _MASK


@dataclass(frozen=True, slots=True)
class Sampled:
    tokens: list[int]  # per row (a failed row keeps its argmax, which nobody uses)
    logprobs: list[float] | None  # per row, when any row asked
    errors: dict[int, str]  # row -> why its sampling failed
    # per row, when any row asked for top_logprobs: its (token, logprob) pairs, most likely
    # first (as many as the row asked for; () for rows that did not)
    top: list[TopLogprobs] | None = None


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab], fp32
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    indices: Sequence[int],  # output index each row samples
    eos_ids: frozenset[int] = frozenset(),
    histories: Sequence[History | None] | None = None,  # for rows whose params penalize
    allowed: Sequence[torch.Tensor | None] | None = None,  # bool [vocab], guided rows
) -> Sampled:
    """The chosen token per row and, if any row asked, the log-probability of each chosen
    token under the model's unmodified distribution (before temperature and filters).
    Invariant: a row whose sampling raises (non-finite probabilities) fails alone, in
    ``errors``; the other rows are sampled as if it were not there."""
    chosen = logits.argmax(dim=-1).tolist()
    errors: dict[int, str] = {}
    for row, p in enumerate(params):
        x = _adjusted(
            logits[row],
            p,
            indices[row],
            eos_ids,
            None if histories is None else histories[row],
            None if allowed is None else allowed[row],
        )
        if p.greedy:
            if x is not None:
                chosen[row] = int(x.argmax())
            continue
        try:
            row_logits = logits[row] if x is None else x
            chosen[row] = _sample_row(row_logits, p, position_seed(seeds[row], indices[row]))
        except RuntimeError as e:  # torch.multinomial: inf / nan / negative probabilities
            errors[row] = f"sampling failed: {e}"
    logprobs = top = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(logits, dim=-1)
        logprobs = lp[torch.arange(len(chosen)), torch.tensor(chosen)].tolist()
        k = max(p.top_logprobs for p in params)
        if k:
            values, ids = lp.topk(k, dim=-1)
            vs, ix = values.tolist(), ids.tolist()
            top = [
                tuple(zip(ix[row][: p.top_logprobs], vs[row][: p.top_logprobs], strict=True))
                for row, p in enumerate(params)
            ]
    return Sampled(chosen, logprobs, errors, top)


def _adjusted(
    logits: torch.Tensor,
    p: SamplingParams,
    index: int,
    eos_ids: frozenset[int],
    history: History | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The row's logits with its ``logit_bias`` added, before ``min_tokens`` its EOS and stop
    tokens removed, then its penalties applied (vLLM's order), then the tokens its grammar
    forbids removed; None when nothing applies (the logits as they are)."""
    banned: set[int] = set()
    if index < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
    penalize = p.penalized and history is not None
    if not p.logit_bias and not banned and not penalize and allowed is None:
        return None
    x = logits.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=x.device)
        x.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=x.device))
    if banned:
        x[torch.tensor(sorted(banned), device=x.device)] = float("-inf")
    if penalize:
        assert history is not None
        _penalize(x, p, *history)
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    return x


def _penalize(x: torch.Tensor, p: SamplingParams, tokens: Sequence[int], num_prompt: int) -> None:
    """In place. Repetition (vLLM's): each distinct token of prompt and output has its logit
    divided by the penalty when positive, multiplied when not. Frequency and presence
    (OpenAI's): each token of the output loses ``frequency * count + presence``."""
    if p.repetition_penalty != 1.0 and tokens:
        seen = torch.tensor(sorted(set(tokens)), device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    out = tokens[num_prompt:]
    if out and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(list(out), device=x.device).unique(return_counts=True)
        x.index_add_(0, ids, -(p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty))


def _sample_row(logits: torch.Tensor, p: SamplingParams, seed: int) -> int:
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    g = torch.Generator(device=logits.device).manual_seed(seed)
    return int(torch.multinomial(probs, 1, generator=g).item())
