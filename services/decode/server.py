"""Decode replica (a plain class; the Ray Serve deployment is made in ``services.app``).

Request lifecycle on a decode replica:
1. ``generate(spec, prefill)`` pulls the request's KV from the prefill replica named in
   ``prefill`` (deadline ``kv_timeout_s``), releases it there, and places it in its own cache;
   given a ``PrefillStarted`` it receives the KV layer by layer while the prefill still runs;
   with ``prefill=None`` (colocated mode, or a short prompt under conditional disaggregation)
   it prefills the prompt itself.
2. The request joins the continuous batch and streams ``TokenChunk``s until a stop condition.
3. A consumer that goes away (client disconnect, cancel) aborts the request: blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kvtransfer.selftest import self_test
from kvtransfer.transport import get_transport
from kvtransfer.wire import TransferError
from services.config import ServeConfig
from services.decode.pull_budget import PullBudget
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.kv_cache import KVCache
from services.engine.kv_handle import KVHandle
from services.pd_flow import (
    GenerateSpec,
    KVTransferFailedError,
    PrefillResult,
    PrefillStarted,
    RouteHint,
    TokenChunk,
)
from services.replica import EngineReplica, open_index

log = logging.getLogger(__name__)


def _failure_reason(e: Exception) -> str:
    if isinstance(e, TimeoutError):
        return "deadline"
    if isinstance(e, UnknownRequestError):
        return "not_held"  # expired on the prefill side, or never held there
    if isinstance(e, LayoutMismatchError):
        return "layout"
    return "transfer"  # corrupt, incomplete, a dead peer


class DecodeServer(EngineReplica):
    """Args: role: ``decode``, or ``both`` in colocated mode; index_handle: see PrefillServer."""

    def __init__(
        self, cfg: ServeConfig, role: Literal["both", "decode"] = "decode", index_handle: Any = None
    ) -> None:
        super().__init__(cfg, cfg.decode, role, open_index(cfg, index_handle))
        transport = get_transport(cfg.kv_transport)  # NOTE: raises if it cannot work here
        if role == "decode":
            self.metrics.observe_self_test(self_test(transport, self.engine.engine.fingerprint))
        self.kv_client = transport.client()
        # NOTE: its own threads: a layer-wise pull waits for the whole prefill, and the event
        # loop's default pool (a handful of threads on a small node) must not run dry
        self._pulls = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-pull")
        # test hook: when set, the next KV pull fails as a lost transfer would
        self.fail_next_pulls = 0
        engine = self.engine.engine
        mc = engine.model_config
        self._block_bytes = KVCache.bytes_per_block(
            mc.num_layers, engine.config.block_size, mc.num_kv_heads, mc.head_dim, engine.kv_dtype
        )
        self.budget = PullBudget(
            cfg.kv_pull_budget_mb << 20, lambda: self.engine.last_stats.blocks_free
        )

    async def _pull(
        self, spec: GenerateSpec, prefill: PrefillResult | PrefillStarted
    ) -> tuple[KVHandle, float]:
        """The request's KV and the transfer time its TTFT could not hide."""
        assert prefill.kv_address is not None
        fp = self.engine.engine.fingerprint
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            if self.fail_next_pulls > 0:
                self.fail_next_pulls -= 1
                raise TransferError("injected transfer failure (test hook)")
            if isinstance(prefill, PrefillStarted):  # layer-wise, while the prefill runs
                handle, finished_unix = await loop.run_in_executor(
                    self._pulls,
                    self.kv_client.pull_stream,  # type: ignore[attr-defined]
                    prefill.kv_address,
                    spec.request_id,
                    fp,
                    self.cfg.request_timeout_s,  # NOTE: it spans the prefill's own time
                    self.cfg.kv_stream_stall_s,  # nothing, not even a heartbeat: give up
                )
                # NOTE: wall clocks of two hosts; clamped, since only the excess is exposed
                return handle, max(0.0, time.time() - finished_unix)
            handle = await loop.run_in_executor(
                self._pulls,
                self.kv_client.pull,
                prefill.kv_address,
                spec.request_id,
                fp,
                self.cfg.kv_timeout_s,
            )
            return handle, time.perf_counter() - start
        except (TransferError, TimeoutError, UnknownRequestError, LayoutMismatchError) as e:
            self.metrics.observe_transfer_failure(_failure_reason(e))
            raise KVTransferFailedError(
                f"KV transfer for {spec.request_id!r} failed: {e}"
            ) from None
        finally:
            # the prefill side frees (or caches) the blocks; its hold timeout covers a lost release
            try:
                await loop.run_in_executor(
                    self._pulls, self.kv_client.release, prefill.kv_address, spec.request_id, 5.0
                )
            except Exception as e:  # the prefill side's hold timeout frees the blocks anyway
                log.warning(
                    "KV release for %s at %s failed: %s", spec.request_id, prefill.kv_address, e
                )

    async def generate(
        self,
        spec: GenerateSpec,
        prefill: PrefillResult | PrefillStarted | None = None,
        route: RouteHint | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """``prefill``: a finished prefill to pull from, a started one to receive layer by
        layer, or None to prefill here. ``route`` is read by the request router in the
        caller's process, not here."""
        nblocks = 0 if prefill is None else -(-len(spec.prompt_ids) // self.cfg.block_size)
        async with self.budget.hold(nblocks * self._block_bytes, nblocks) as imported:
            async for chunk in self._generate(spec, prefill, imported):
                yield chunk

    async def _generate(
        self,
        spec: GenerateSpec,
        prefill: PrefillResult | PrefillStarted | None,
        imported: Callable[[], None],
    ) -> AsyncIterator[TokenChunk]:
        """``generate`` inside the pull budget; ``imported`` gives the request's share back
        once its KV is in the paged cache (by its first output)."""
        handle = None
        transfer_s, transfer_bytes = 0.0, 0
        start = time.perf_counter()
        if prefill is not None:
            handle, transfer_s = await self._pull(spec, prefill)
            transfer_bytes = handle.nbytes
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
                elif prefill is None:
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
            )
            transfer_s, transfer_bytes = 0.0, 0

    def kv_transfer_failures(self) -> dict[str, int]:
        """Failed pulls by reason (operators, tests)."""
        return dict(self.metrics.transfer_failures)

    def set_fail_next_pulls(self, n: int) -> None:
        self.fail_next_pulls = n

    def __del__(self) -> None:
        # NOTE: replicas are torn down by Ray; stop the publisher and the loop thread
        self._pulls.shutdown(wait=False, cancel_futures=True)
        self.shutdown()
