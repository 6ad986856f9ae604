"""Prefill replica (a plain class; the Ray Serve deployment is made in ``services.app``).

Request lifecycle on a prefill replica:
1. ``prefill(spec)`` runs the prompt (prefix-cache reuse, chunked) as a prefill-only request.
2. The first token is sampled; the request's KV blocks are HELD by the engine.
3. The reply names this replica's KV transfer address; a decode replica pulls the blocks and
   releases them, or the engine frees them after ``kv_hold_timeout_s``.
Layer-wise (``prefill_stream``, transports that stream): a KV stream is opened and named
*before* step 1, the engine puts each layer's KV into it as it is written, and the decode
replica receives it while the prefill runs; the blocks are still held until released.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

from kvtransfer.selftest import self_test
from kvtransfer.source import EngineKVSource
from kvtransfer.stream import KVStream
from kvtransfer.transport import get_transport
from services.config import ServeConfig
from services.engine.async_engine import EngineStalledError
from services.engine.request import FinishReason, RequestOutput
from services.pd_flow import GenerateSpec, PrefillResult, PrefillStarted, RouteHint
from services.replica import EngineReplica, node_ip, open_index, replica_identity


class PrefillServer(EngineReplica):
    """Args: index_handle: the application's ``prefix_index`` deployment (in-process index);
    unused when ``cfg.redis_url`` is set."""

    def __init__(self, cfg: ServeConfig, index_handle: Any = None) -> None:
        super().__init__(cfg, cfg.prefill, "prefill", open_index(cfg, index_handle))
        transport = get_transport(cfg.kv_transport)  # NOTE: raises if it cannot work here
        self.metrics.observe_self_test(self_test(transport, self.engine.engine.fingerprint))
        self.kv_source = EngineKVSource(
            self.engine.engine, self.engine.lock, cfg.kv_stream_buffer_mb << 20, self._progressing
        )
        self.streaming = transport.streaming
        options: dict[str, Any] = {"lease_s": cfg.kv_hold_timeout_s}
        if transport.name in ("grpc", "shm"):
            # NOTE: a layer-wise StreamKV holds one server thread for a whole prefill: one per
            # request this replica may run at once, plus a few for pulls and releases (4 fixed
            # threads let 4 long prefills starve every other transfer)
            options["max_workers"] = cfg.prefill.max_num_seqs + 4
        self.kv_server = transport.serve(self.kv_source, node_ip(), cfg.kv_port, **options)

    def _progressing(self) -> bool:
        """The engine loop runs and steps (streams send heartbeats only then): half the
        receivers' stall timeout without a finished step counts as stalled."""
        try:
            self.engine.check_alive(self.cfg.kv_stream_stall_s / 2)
        except EngineStalledError:
            return False
        return True

    async def prefill(self, spec: GenerateSpec, route: RouteHint | None = None) -> PrefillResult:
        """``route`` is read by the request router in the caller's process, not here."""
        return await self._prefill(spec, None)

    async def prefill_stream(
        self, spec: GenerateSpec, route: RouteHint | None = None
    ) -> AsyncIterator[PrefillStarted | PrefillResult]:
        """Layer-wise: yields ``PrefillStarted`` at once (the KV stream is open, a decode
        replica may attach), then the ``PrefillResult`` when the prefill is done."""
        if not self.streaming:
            raise ValueError(f"KV transport {self.cfg.kv_transport!r} does not stream")
        stream = self.kv_source.open_stream(spec.request_id, len(spec.prompt_ids))
        try:
            yield PrefillStarted(spec.request_id, self.kv_server.address)
            yield await self._prefill(spec, stream)
        finally:
            # NOTE: a no-op once the prefill finished (the hold's end closes it); otherwise
            # (an error, the caller went away) the receiver learns at once
            if not stream.finished:
                stream.fail("the prefill call ended early")

    async def _prefill(self, spec: GenerateSpec, sink: KVStream | None) -> PrefillResult:
        out: RequestOutput | None = None
        async for o in self.engine.generate(
            spec.request_id, spec.prompt_ids, spec.params, prefill_only=True, kv_sink=sink
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
            kv_address=self.kv_server.address if held else None,
            queue_s=queue_s,
            prefill_s=prefill_s,
            num_cached_tokens=out.num_cached_tokens,
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

    def kv_stream_stats(self) -> dict[str, int]:
        """Layer-wise streams: receivers that attached while the prefill ran ("early": the
        transfer overlapped it) or after it ("late"), streams open now, streams that spilled
        (the stream buffer was full) and the bytes queued now."""
        return self.kv_source.stream_stats()

    def __del__(self) -> None:
        # NOTE: replicas are torn down by Ray; stop the transport server and the loop thread
        self.kv_server.stop(0)
        self.shutdown()
