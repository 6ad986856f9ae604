"""Prefill replica (a plain class; the Ray Serve deployment is made in ``services.app``).

Request lifecycle on a prefill replica (``handoff``):
1. An entry is opened in the replica's ``Outbox`` (``kvtransfer.outbox``), the one owner of
   the request's KV handoff; the reply's ``KVRef`` names it. Layer-wise (the transport streams
   and ``kv_streaming`` is on: decided here, nowhere else), the ref is yielded at once, so a
   decode replica attaches and receives each layer while the prefill computes the next.
2. The prompt runs as a prefill-only request (prefix-cache reuse, chunked) with the entry as
   its ``kv_sink``; the first token is sampled and the entry holds the blocks (HELD).
3. A decode replica pulls (or has streamed) the blocks and releases them, or the entry's lease
   (``kv_hold_timeout_s``) frees them.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

from kvtransfer.outbox import Entry, Outbox, OutboxConfig
from kvtransfer.selftest import self_test
from services.config import ServeConfig
from services.engine.async_engine import EngineStalledError
from services.engine.request import FinishReason, RequestOutput
from services.pd_flow import (
    GenerateSpec,
    KVRef,
    PrefillResult,
    RouteHint,
    prompt_logprobs_of,
)
from services.replica import EngineReplica, kv_transport, node_ip, open_index, replica_identity


class PrefillServer(EngineReplica):
    """Args: index_handle: the application's ``prefix_index`` deployment (in-process index);
    unused when ``cfg.redis_url`` is set."""

    def __init__(self, cfg: ServeConfig, index_handle: Any = None) -> None:
        super().__init__(cfg, cfg.prefill, "prefill", open_index(cfg, index_handle))
        transport = kv_transport(cfg)  # NOTE: raises if it cannot work here
        engine = self.engine.engine
        self.metrics.observe_self_test(self_test(transport, engine.fingerprint))
        self.outbox = Outbox(
            engine.fingerprint,
            # NOTE: through the turnstile: the receiver's release frees at once when the lock
            # is free, else the Outbox's freer (and a late receiver's read) gets it at the end
            # of the step in flight; the bare lock let the busy loop win it for several steps
            lambda: self.engine.turnstile,
            OutboxConfig(cfg.kv_hold_timeout_s, cfg.kv_stream_buffer_mb << 20),
            progressing=self._progressing,
        )
        # NOTE: the one place that decides whether handoffs stream layer by layer
        self.layerwise = cfg.kv_streaming and transport.streaming
        options: dict[str, Any] = {"lease_s": cfg.kv_hold_timeout_s}
        if transport.name in ("grpc", "shm"):
            # NOTE: a layer-wise StreamKV holds one server thread for a whole prefill: one per
            # request this replica may run at once, plus a few for pulls and releases (4 fixed
            # threads let 4 long prefills starve every other transfer)
            options["max_workers"] = cfg.prefill.max_num_seqs + 4
        host = node_ip() if cfg.kv_host == "auto" else cfg.kv_host
        self.kv_server = transport.serve(self.outbox, host, cfg.kv_port, **options)
        self._leases_stop = threading.Event()
        threading.Thread(target=self._expire_leases, name="kv-leases", daemon=True).start()

    def _expire_leases(self) -> None:
        period = min(1.0, self.cfg.kv_hold_timeout_s / 4)
        denied = 0
        while not self._leases_stop.wait(period):
            self.metrics.observe_lease_expiries(self.outbox.expire())
            now = self.outbox.denied  # NOTE: and the refused KV calls, exported as they come
            self.metrics.observe_kv_denied(now - denied)
            denied = now

    def _progressing(self) -> bool:
        """The engine loop runs and steps (streams send heartbeats only then): half the
        receivers' stall timeout without a finished step counts as stalled."""
        try:
            self.engine.check_alive(self.cfg.kv_stream_stall_s / 2)
        except EngineStalledError:
            return False
        return True

    async def handoff(
        self, spec: GenerateSpec, route: RouteHint | None = None, layerwise: bool = True
    ) -> AsyncIterator[KVRef | PrefillResult]:
        """The prefill and its KV handoff: a layer-wise ``KVRef`` at once when this replica
        streams (and ``layerwise``: the gateway asks for a whole pull when it re-prefills),
        then the ``PrefillResult`` (its ``kv`` is the ref to take the KV by, None when the first
        token ended the request). ``route`` is read by the request router in the caller's
        process, not here."""
        layerwise = layerwise and self.layerwise
        entry = self.outbox.open(spec.request_id, len(spec.prompt_ids), layerwise)
        ref = KVRef(spec.request_id, self.kv_server.address, layerwise, entry.secret)
        try:
            if layerwise:
                yield ref
            yield await self._prefill(spec, entry, ref)
        finally:
            # NOTE: a no-op once prefilled (the release or the lease ends it); otherwise (an
            # error, the caller went away) the receiver learns at once
            self.outbox.cancel(spec.request_id, "the prefill call ended early")

    async def _prefill(self, spec: GenerateSpec, entry: Entry, ref: KVRef) -> PrefillResult:
        out: RequestOutput | None = None
        async for o in self.engine.generate(
            spec.request_id, spec.prompt_ids, spec.params, prefill_only=True, kv_sink=entry
        ):
            out = o
        assert out is not None and out.finished
        queue_s, prefill_s = out.queue_s or 0.0, out.prefill_s or 0.0
        self.metrics.observe_first_token(out.ttft_s or queue_s + prefill_s, queue_s, prefill_s)
        held = out.finish_reason is FinishReason.PREFILLED
        return PrefillResult(
            request_id=spec.request_id,
            first_token=out.new_token_ids[0],
            first_text=out.new_text,
            first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
            finish_reason=None if held else str(out.finish_reason),
            kv=ref if held else None,
            queue_s=queue_s,
            prefill_s=prefill_s,
            num_cached_tokens=out.num_cached_tokens,
            first_top_logprobs=out.new_top_logprobs[0] if out.new_top_logprobs else None,
            prompt_logprobs=prompt_logprobs_of(out.prompt_logprobs),
        )

    def corrupt_next_kv_pieces(self, n: int) -> str:
        """Fault injection (the fault suite and ``bench/fault_bench.py``): flip one bit in each
        of the next ``n`` KV data messages this replica sends (stream pieces or pull chunks),
        as a bad NIC or memory would; receivers must catch it by checksum. gRPC transport.
        Returns this replica's identity (which replica the call reached)."""
        server = self.kv_server
        if not hasattr(server, "set_message_hook") or self.cfg.kv_transport != "grpc":
            raise ValueError(
                f"corruption is injected on the grpc transport only, not {self.cfg.kv_transport!r}"
            )
        left = [n]
        lock = threading.Lock()

        def flip(msg: Any) -> Any:
            kind = msg.WhichOneof("msg")
            part = msg.piece if kind == "piece" else msg.chunk if kind == "chunk" else None
            if part is None or not part.data:
                return msg
            with lock:
                if left[0] <= 0:
                    return msg
                left[0] -= 1
                if left[0] == 0:
                    server.set_message_hook(None)
            data = bytearray(part.data)
            data[len(data) // 2] ^= 0x08
            part.data = bytes(data)
            return msg

        server.set_message_hook(flip if n > 0 else None)
        return replica_identity()

    def kv_handoff_stats(self) -> dict[str, int]:
        """The Outbox: handoffs by live state (open, streaming, held), ended ones by how
        (ended_released, ended_expired, ended_failed), receivers that attached while the
        prefill ran ("early": the transfer overlapped it) or after it ("late"), streams that
        spilled (the stream buffer was full) and the bytes queued now."""
        return self.outbox.stats()

    def __del__(self) -> None:
        # NOTE: replicas are torn down by Ray; stop the transport server, the leases and the
        # loop thread
        self._leases_stop.set()
        self.kv_server.stop(0)
        self.outbox.close()
        self.shutdown()
