"""Prompt-lookup (n-gram) drafts for speculative decoding.

The draft for a request is what followed the most recent earlier occurrence of its last n
tokens (n from ``n_max`` down to ``n_min``) in its own prompt and output. Copy-heavy work
(editing, summarising, extracting from a given text, code) repeats long spans of its input,
and a draft costs no model at all. The engine verifies drafts exactly (``Engine.step``), so
they change speed, never tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` draft tokens to follow ``tokens``; [] when no n-gram of the tail recurs."""
    size = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = list(tokens[size - n :])
        # NOTE: scan backwards for the latest match: recent context predicts best
        for start in range(size - n - 1, -1, -1):
            if tokens[start] == tail[0] and list(tokens[start : start + n]) == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return list(follow)
    return []
