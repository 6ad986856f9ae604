"""Overload protection at the gateway: a bound on the requests one gateway replica serves at
once (HTTP and gRPC together), refused with a retry hint instead of queued without end."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge


class OverloadedError(RuntimeError):
    """Refused for overload (HTTP 429 with Retry-After / RESOURCE_EXHAUSTED with a
    ``retry-after-ms`` trailer). ``retry_after_s``: when a retry may succeed."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Counts the requests in flight; ``slot()`` admits one or raises ``OverloadedError``.

    Invariant: only touched from the gateway's event loop (the HTTP app and the gRPC server
    share it), so the count needs no lock; every admitted request leaves through ``slot``'s
    ``finally``, whatever ends it (finish, error, client cancel)."""

    def __init__(self, limit: int, retry_after_s: float, registry: CollectorRegistry) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self._gauge = Gauge(
            "pdserve_gateway_inflight_requests",
            "requests this gateway is serving",
            registry=registry,
        )
        self._refused = Counter(
            "pdserve_gateway_overload_refusals", "requests refused for overload", registry=registry
        )

    @contextmanager
    def slot(self) -> Iterator[None]:
        if self.inflight >= self.limit:
            self._refused.inc()
            raise OverloadedError(
                f"the gateway is serving its limit of {self.limit} requests; retry later",
                self.retry_after_s,
            )
        self.inflight += 1
        self._gauge.set(self.inflight)
        try:
            yield
        finally:
            self.inflight -= 1
            self._gauge.set(self.inflight)
