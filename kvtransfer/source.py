"""``KVSource`` over an engine's HELD (prefill-only, finished) requests."""

from __future__ import annotations

import contextlib
import threading

from services.engine.engine import Engine
from services.engine.errors import UnknownRequestError
from services.engine.kv_handle import KVHandle


class EngineKVSource:
    """Serves ``engine.export_kv`` / ``engine.release_kv``.

    Args:
        lock: the lock that also guards the engine's step loop (the engine is single-threaded;
            the transport server calls in from its own threads).
    """

    def __init__(self, engine: Engine, lock: threading.Lock) -> None:
        self.engine = engine
        self.lock = lock

    def get(self, request_id: str) -> KVHandle | None:
        with self.lock:
            try:
                return self.engine.export_kv(request_id)
            except UnknownRequestError:
                return None

    def release(self, request_id: str) -> None:
        # already released or expired: release is idempotent
        with self.lock, contextlib.suppress(UnknownRequestError):
            self.engine.release_kv(request_id)
