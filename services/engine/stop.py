"""Stop conditions: EOS, stop token ids, stop strings, max_tokens and the context limit."""

from __future__ import annotations

from collections.abc import Set

from services.engine.request import FinishReason, Request


class StopChecker:
    @staticmethod
    def check(
        req: Request, token: int, eos_ids: Set[int], max_model_len: int
    ) -> FinishReason | None:
        """Called after ``token`` was appended (and detokenized); truncates ``req.text`` at a
        stop string. Returns the finish reason, or None to continue."""
        p = req.params
        if req.num_tokens - req.num_prompt < p.min_tokens:
            # NOTE: no EOS, stop token or stop string ends it before min_tokens (the sampler
            # does not draw EOS and stop tokens there); the limits still do
            return FinishReason.LENGTH if req.num_tokens >= max_model_len else None
        if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop:
            # only the newest characters can complete a stop string
            window = max(len(s) for s in p.stop) + 16
            start = max(0, len(req.text) - window)
            hits = [i for s in p.stop if (i := req.text.find(s, start)) >= 0]
            if hits:
                req.text = req.text[: min(hits)]
                return FinishReason.STOP
        if req.num_tokens - req.num_prompt >= p.max_tokens or req.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def visible_len(req: Request) -> int:
        """How much of ``req.text`` may be streamed now: text that could still turn out to be
        the start of a stop string is held back until it is decided."""
        text = req.text
        hold = 0
        for s in req.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold
