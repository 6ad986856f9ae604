"""The KV transport interface and its registry.

A prefill replica runs a transport *server* over a ``KVSource`` (its engine's held requests);
a decode replica *pulls* a request's blocks with the transport client and then releases them.
NOTE: pull, not push: the decode replica knows when it has room for the blocks, so it pulls
when it can place them, and the prefill side never buffers for a receiver that is not ready.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from services.engine.kv_handle import KVHandle, LayoutFingerprint

if TYPE_CHECKING:
    from kvtransfer.stream import KVStream


class KVSource(Protocol):
    """What a transport server serves from (a prefill engine's held requests)."""

    def get(self, request_id: str) -> KVHandle | None:
        """The request's handle, or None if it is not held here."""
        ...

    def release(self, request_id: str) -> None:
        """Free the request's blocks; idempotent."""
        ...


@runtime_checkable
class StreamingKVSource(KVSource, Protocol):
    """A source that also serves layer-wise streams (what a ``streaming`` transport's server
    needs; ``EngineKVSource`` is one)."""

    def stream(self, request_id: str) -> KVStream | None:
        """The request's open stream, or None."""
        ...

    def stream_attached(self, early: bool) -> None:
        """Count a receiver that attached while the prefill ran (``early``) or after it."""
        ...


class KVServer(Protocol):
    @property
    def address(self) -> str: ...

    def stop(self) -> None: ...


class KVClient(Protocol):
    def pull(
        self, address: str, request_id: str, layout: LayoutFingerprint, timeout_s: float
    ) -> KVHandle:
        """Fetch and verify a request's blocks.

        Raises:
            UnknownRequestError: the sender does not hold the request.
            LayoutMismatchError: the sender's layout differs from ``layout``.
            kvtransfer.wire.TransferError: corrupt, incomplete or failed transfer.
            TimeoutError: the deadline passed.
        """
        ...

    def release(self, address: str, request_id: str, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class StreamingKVClient(KVClient, Protocol):
    """A client of a transport whose ``streaming`` is True."""

    def pull_stream(
        self,
        address: str,
        request_id: str,
        layout: LayoutFingerprint,
        timeout_s: float,
        stall_s: float | None = None,
    ) -> tuple[KVHandle, float]:
        """Receive a request's KV layer by layer while the sender prefills it (the sender
        opened the stream first); returns the handle and when the sender finished computing
        it (Unix seconds). Raises as ``pull`` does; ``kvtransfer.stream.StreamFailedError``
        (a TransferError) when the prefill ended without KV to hand over; TimeoutError when
        nothing came, not even a heartbeat, for ``stall_s`` (None: only ``timeout_s``)."""
        ...


class Transport(Protocol):
    name: str
    streaming: bool  # the server serves layer-wise streams, the client has ``pull_stream``

    def serve(self, source: KVSource, host: str, port: int, **options: Any) -> KVServer: ...

    def client(self) -> KVClient: ...


def _load_grpc() -> Transport:
    from kvtransfer.grpc_transport import GrpcTransport

    return GrpcTransport()


def _load_shm() -> Transport:
    from kvtransfer.grpc_transport import GrpcTransport

    return GrpcTransport(shared_memory=True)


def _load_gloo() -> Transport:
    from kvtransfer.dist_transport import DistTransport

    return DistTransport("gloo")


def _load_nccl() -> Transport:
    from kvtransfer.dist_transport import DistTransport

    return DistTransport("nccl")


# NOTE: lazy: a transport's dependencies load only when it is chosen
TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "grpc": _load_grpc,
    "shm": _load_shm,
    "gloo": _load_gloo,
    "nccl": _load_nccl,
}


# NOTE: known without importing a transport (the gateway decides the flow by it)
STREAMING = frozenset({"grpc", "shm", "gloo", "nccl"})


def get_transport(name: str) -> Transport:
    """Instantiate a transport by name; the error lists the valid names."""
    try:
        return TRANSPORTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; choose one of: {', '.join(TRANSPORTS)}"
        ) from None
