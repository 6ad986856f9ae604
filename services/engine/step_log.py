"""What the engine's steps cost, by what they carried: the evidence behind ``pdserve doctor``'s
questions on ITL against batch size and on prefill chunks stalling decodes.

Steps are counted by (decode rows, rounded up to a power of two; whether a prompt chunk rode
along). Each bucket keeps its step count, total seconds, decode rows, prompt tokens and the
engine thread's CPU seconds in those steps, so a reader gets the mean step time of pure-decode
steps at each batch size, what a prompt chunk adds to them, and how much of a step's wall time
the engine thread actually ran (on a CPU engine the rest is time it waited: for a core that
other threads or processes hold, or for the GIL; a starved engine, not a slow one).

Invariant: written by the engine thread only; a snapshot is a plain copy made under the GIL
(the bucket dict's values are replaced whole, never mutated), so any thread may take one
without the engine lock.
"""

from __future__ import annotations

from typing import Any

Bucket = tuple[int, float, int, int, float]  # steps, seconds, decode rows, prompt tokens, CPU s


def rows_bucket(rows: int) -> int:
    """The smallest power of two >= ``rows`` (0 for a step without decode rows)."""
    return 0 if rows <= 0 else 1 << (rows - 1).bit_length()


class StepLog:
    def __init__(self) -> None:
        self._buckets: dict[tuple[int, bool], Bucket] = {}

    def record(
        self, decode_rows: int, prompt_tokens: int, seconds: float, cpu_seconds: float
    ) -> None:
        """``cpu_seconds``: the engine thread's CPU time in the step (``time.thread_time``)."""
        key = (rows_bucket(decode_rows), prompt_tokens > 0)
        n, s, r, p, c = self._buckets.get(key, (0, 0.0, 0, 0, 0.0))
        self._buckets[key] = (
            n + 1,
            s + seconds,
            r + decode_rows,
            p + prompt_tokens,
            c + cpu_seconds,
        )

    def snapshot(self) -> list[dict[str, Any]]:
        """One entry per bucket: ``rows`` (bucket), ``with_prompt``, ``steps``, ``seconds``,
        ``decode_rows``, ``prompt_tokens``, ``cpu_seconds`` (totals)."""
        return [
            {
                "rows": rows,
                "with_prompt": with_prompt,
                "steps": n,
                "seconds": s,
                "decode_rows": r,
                "prompt_tokens": p,
                "cpu_seconds": c,
            }
            for (rows, with_prompt), (n, s, r, p, c) in sorted(dict(self._buckets).items())
        ]
