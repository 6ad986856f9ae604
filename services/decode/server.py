"""Decode replica (a plain class; the Ray Serve deployment is made in ``services.app``).

Request lifecycle on a decode replica:
1. ``generate(spec, kv)`` receives the request's KV through the replica's ``Inbox``
   (``kvtransfer.inbox``: a whole pull, or a layer-wise stream while the prefill still runs, as
   the ``KVRef`` says), which releases it at the prefill replica either way, and places it in
   its own cache; with ``kv=None`` (colocated mode, or a short prompt under conditional
   disaggregation) it prefills the prompt itself.
2. The request joins the continuous batch and streams ``TokenChunk``s until a stop condition.
3. A consumer that goes away (client disconnect, cancel) aborts the request: blocks are freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kvtransfer.inbox import Inbox, InboxConfig, Received
from kvtransfer.selftest import self_test
from services.config import ServeConfig
from services.decode.pull_budget import PullBudget
from services.engine.kv_cache import KVCache
from services.pd_flow import (
    GenerateSpec,
    KVRef,
    KVTransferFailedError,
    RouteHint,
    TokenChunk,
    prompt_logprobs_of,
)
from services.replica import EngineReplica, kv_transport, open_index


class DecodeServer(EngineReplica):
    """Args: role: ``decode``, or ``both`` in colocated mode; index_handle: see PrefillServer."""

    def __init__(
        self, cfg: ServeConfig, role: Literal["both", "decode"] = "decode", index_handle: Any = None
    ) -> None:
        super().__init__(cfg, cfg.decode, role, open_index(cfg, index_handle))
        transport = kv_transport(cfg)  # NOTE: raises if it cannot work here
        if role == "decode":
            self.metrics.observe_self_test(self_test(transport, self.engine.engine.fingerprint))
        self.inbox = Inbox(
            transport.client(),
            self.engine.engine.fingerprint,
            InboxConfig(
                pull_timeout_s=cfg.kv_timeout_s,
                stream_timeout_s=cfg.request_timeout_s,  # NOTE: it spans the prefill's own time
                stall_s=cfg.kv_stream_stall_s,  # nothing, not even a heartbeat: give up
            ),
        )
        # NOTE: its own threads: a layer-wise pull waits for the whole prefill, and the event
        # loop's default pool (a handful of threads on a small node) must not run dry
        self._pulls = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-pull")
        engine = self.engine.engine
        mc = engine.model_config
        self._block_bytes = KVCache.bytes_per_block(
            mc.num_layers, engine.config.block_size, mc.num_kv_heads, mc.head_dim, engine.kv_dtype
        )
        self.budget = PullBudget(
            cfg.kv_pull_budget_mb << 20, lambda: self.engine.last_stats.blocks_free
        )

    async def _receive(self, request_id: str, kv: KVRef) -> Received:
        loop = asyncio.get_running_loop()
        wait_s = self.cfg.kv_join_wait_ms / 1e3

        def expect() -> None:  # every layer is in: the add follows the trailer
            self.engine.expect(request_id, wait_s)

        try:
            return await loop.run_in_executor(self._pulls, self.inbox.receive, kv, expect)
        except KVTransferFailedError as e:
            self.metrics.observe_transfer_failure(e.reason)
            raise

    async def generate(
        self, spec: GenerateSpec, kv: KVRef | None = None, route: RouteHint | None = None
    ) -> AsyncIterator[TokenChunk]:
        """``kv``: where the prefill replica holds (or streams) the request's KV; None to
        prefill here. ``route`` is read by the request router in the caller's process, not
        here."""
        nblocks = 0 if kv is None else -(-len(spec.prompt_ids) // self.cfg.block_size)
        async with self.budget.hold(nblocks * self._block_bytes, nblocks) as imported:
            async for chunk in self._generate(spec, kv, imported):
                yield chunk

    async def _generate(
        self,
        spec: GenerateSpec,
        kv: KVRef | None,
        imported: Callable[[], None],
    ) -> AsyncIterator[TokenChunk]:
        """``generate`` inside the pull budget; ``imported`` gives the request's share back
        once its KV is in the paged cache (by its first output)."""
        handle = None
        transfer_s, transfer_bytes = 0.0, 0
        start = time.perf_counter()
        if kv is not None:
            got = await self._receive(spec.request_id, kv)
            handle, transfer_s, transfer_bytes = got.handle, got.exposed_s, got.nbytes
            self.metrics.observe_transfer(transfer_s, transfer_bytes)
        last: float | None = None
        async for out in self.engine.generate(
            spec.request_id, spec.prompt_ids, spec.params, kv_handle=handle
        ):
            imported()
            if not out.new_token_ids and not out.finished:
                continue
            now = time.perf_counter()
            if out.new_token_ids:
                # NOTE: only gaps between this replica's own steps are ITL; the first token
                # after a KV pull waited for the transfer, and a prefill here is TTFT
                if last is not None:
                    self.metrics.observe_gap(now - last)
                elif kv is None:
                    q, p = out.queue_s or 0.0, out.prefill_s or 0.0
                    self.metrics.observe_first_token(out.ttft_s or q + p, q, p)
                last = now
            if out.finished:
                self.metrics.observe_finish(now - start)
            yield TokenChunk(
                token_ids=tuple(out.new_token_ids),
                text=out.new_text,
                logprobs=tuple(out.new_logprobs) if out.new_logprobs is not None else None,
                finish_reason=str(out.finish_reason) if out.finished else None,
                num_cached_tokens=out.num_cached_tokens,
                kv_transfer_s=transfer_s,
                kv_transfer_bytes=transfer_bytes,
                top_logprobs=(
                    tuple(out.new_top_logprobs) if out.new_top_logprobs is not None else None
                ),
                prompt_logprobs=prompt_logprobs_of(out.prompt_logprobs),
            )
            transfer_s, transfer_bytes = 0.0, 0

    def kv_transfer_failures(self) -> dict[str, int]:
        """Failed pulls by reason (operators, tests)."""
        return dict(self.inbox.failures)  # NOTE: the Inbox counts; Ray's counter follows

    def set_fail_next_pulls(self, n: int) -> None:
        """Test hook: the next ``n`` receives fail as a lost transfer would."""
        self.inbox.fail_next = n

    def kv_receives_in_flight(self) -> dict[str, str]:
        """Receives under way by request id (empty once idle: nothing leaked)."""
        return self.inbox.in_flight()

    def __del__(self) -> None:
        # NOTE: replicas are torn down by Ray; stop the publisher and the loop thread
        self._pulls.shutdown(wait=False, cancel_futures=True)
        self.inbox.close()
        self.inbox.client.close()
        self.shutdown()
