"""``KVSource`` over an engine's HELD (prefill-only, finished) requests and its open
layer-wise streams."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtransfer.stream import KVStream, StreamBuffer
from services.engine.engine import Engine
from services.engine.errors import UnknownRequestError
from services.engine.kv_handle import KVHandle


class EngineKVSource:
    """Serves ``engine.export_kv`` / ``engine.release_kv``, and the streams ``open_stream``
    made (the engine fills them; see ``kvtransfer.stream``).

    Args:
        lock: the lock that also guards the engine's step loop (the engine is single-threaded;
            the transport server calls in from its own threads).
        stream_buffer_bytes: bound on the pieces queued across the open streams (a stream
            that would pass it spills: see ``kvtransfer.stream``); None = unbounded.
        progressing: whether the engine makes progress (streams send heartbeats only then);
            None = always.
    """

    def __init__(
        self,
        engine: Engine,
        lock: threading.Lock,
        stream_buffer_bytes: int | None = None,
        progressing: Callable[[], bool] | None = None,
    ) -> None:
        self.progressing = progressing
        self.engine = engine
        self.lock = lock
        self.buffer = None if stream_buffer_bytes is None else StreamBuffer(stream_buffer_bytes)
        self._streams: dict[str, KVStream] = {}
        self._streams_lock = threading.Lock()  # NOTE: never the engine lock: no step waits
        # receivers that attached while the prefill ran (the transfer overlapped it) / after
        self.attached = {"early": 0, "late": 0}

    def get(self, request_id: str) -> KVHandle | None:
        try:
            return self._export(request_id)
        except UnknownRequestError:
            return None

    def _export(self, request_id: str) -> KVHandle:
        with self.lock:
            return self.engine.export_kv(request_id)

    def release(self, request_id: str) -> None:
        # already released or expired: release is idempotent; still computing (a streaming
        # receiver gave up): freed as soon as its prefill ends
        with self.lock:
            self.engine.drop_kv(request_id)
        stream = self.stream(request_id)
        if stream is not None:
            stream.fail("the receiver released it")

    def open_stream(self, request_id: str, num_tokens: int) -> KVStream:
        """A stream for a request about to be added with it as its ``kv_sink``."""

        def close() -> None:
            with self._streams_lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]

        stream = KVStream(
            request_id,
            self.engine.fingerprint,
            num_tokens,
            close,
            self.buffer,
            lambda: self._export(request_id),
            self.progressing,
        )
        with self._streams_lock:
            self._streams[request_id] = stream
        return stream

    def stream(self, request_id: str) -> KVStream | None:
        with self._streams_lock:
            return self._streams.get(request_id)

    def stream_attached(self, early: bool) -> None:
        with self._streams_lock:
            self.attached["early" if early else "late"] += 1

    def stream_stats(self) -> dict[str, int]:
        """Receivers that attached early / late, streams open now, streams that spilled (sent
        from the held KV at the end: the stream buffer was full), bytes queued now."""
        with self._streams_lock:
            stats = {**self.attached, "open": len(self._streams)}
        if self.buffer is not None:
            stats |= {"spilled": self.buffer.spilled, "queued_bytes": self.buffer.used}
        return stats
