"""Continuous-batching scheduler: a thin loop over the block manager and two queues.

Each step:
1. Running requests (decodes and unfinished chunked prefills) get their tokens first, in
   arrival order; when blocks run out the most recently admitted request is preempted (its
   blocks freed, its tokens recomputed later, mostly from the prefix cache).
2. Waiting requests are admitted while the token budget, the running cap and the blocks allow;
   each reuses its longest cached prefix (or an imported KV handle) and prefills the rest in
   chunks of at most the remaining budget.
Prefill chunks and decodes of different requests share a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.ngram import propose
from services.engine.request import Request, Status


@dataclass(frozen=True, slots=True)
class ScheduledSpan:
    request: Request
    start: int  # first position computed this step
    num_new: int  # positions computed, the draft's included
    # speculative draft tokens after the request's last token; their positions are computed
    # and every one of the span's rows is sampled to verify them
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this span reaches the end of the request's tokens (a new token is due)."""
        return self.start + self.num_new == self.request.num_tokens + len(self.draft)

    @property
    def num_sampled(self) -> int:
        return (1 + len(self.draft)) if self.samples else 0

    @property
    def prompt_positions(self) -> range:
        """Positions computed this step whose logits score the next prompt token and are not
        scored yet (requests with ``prompt_logprobs``)."""
        req = self.request
        if req.params.prompt_logprobs is None:
            return range(0)
        return range(
            max(self.start, len(req.prompt_logprobs)),
            min(self.start + self.num_new, req.num_prompt - 1),
        )

    def token_ids(self) -> list[int]:
        """The ids of the positions computed: the request's tokens, then the draft."""
        end = self.start + self.num_new - len(self.draft)
        return [*self.request.token_ids[self.start : end], *self.draft]


@dataclass(slots=True)
class SchedulerOutput:
    spans: list[ScheduledSpan] = field(default_factory=list)
    # (request, block ids freshly allocated for the imported handle's blocks, first block index)
    imports: list[tuple[Request, list[int], int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            draft = self._draft(req, budget) if n == 1 else ()
            n += len(draft)
            while self.blocks.allocate(req.request_id, req.num_computed + n) is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.spans.append(ScheduledSpan(req, req.num_computed, n, draft))
                budget -= n
                i += 1
        if out.preempted:
            return out  # NOTE: no admission in a step that had to preempt: blocks are short
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            span = self._admit(req, budget, out)
            if span is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            out.spans.append(span)
            budget -= span.num_new
        return out

    def _draft(self, req: Request, budget: int) -> tuple[int, ...]:
        """Prompt-lookup draft for a decoding request (never past its max_tokens or the
        step's budget); () when speculation is off or finds nothing."""
        cfg = self.config
        room = min(
            cfg.speculative_tokens,
            budget - 1,
            req.params.max_tokens - (req.num_tokens - req.num_prompt) - 1,
        )
        # NOTE: a guided request's draft positions would each need the grammar's mask after
        # the drafts before them; it is not drafted for instead
        if room <= 0 or req.prefill_only or req.params.response_format is not None:
            return ()
        return tuple(propose(req.token_ids, room, cfg.prompt_lookup_max, cfg.prompt_lookup_min))

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> ScheduledSpan | None:
        bs = self.blocks.block_size
        handle = req.kv_import
        # At least the last token is always computed: its logits give the next token.
        reusable = (handle.num_computed if handle is not None else req.num_tokens - 1) // bs
        if handle is None and req.params.prompt_logprobs is not None:
            # NOTE: cached positions have no logits: only what is already scored is reused
            reusable = min(reusable, len(req.prompt_logprobs) // bs)
        hits = self.blocks.lookup_prefix(req.block_hashes[:reusable])
        start = handle.num_computed if handle is not None else len(hits) * bs
        n = min(req.num_tokens - start, budget)
        new = self.blocks.allocate(req.request_id, start + n, hits)
        if new is None:
            return None
        req.num_computed = start
        if req.num_preemptions == 0:
            req.num_cached_tokens = len(hits) * bs
        if handle is not None:
            table = self.blocks.block_table(req.request_id)
            out.imports.append((req, table[len(hits) : handle.num_blocks], len(hits)))
        return ScheduledSpan(req, start, n)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.blocks.free(req.request_id)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        # NOTE: running requests never hold a kv_import (the engine drops it once copied in),
        # so a preempted request always recomputes from its tokens, mostly from the prefix cache.
        self.waiting.appendleft(req)
        out.preempted.append(req)
