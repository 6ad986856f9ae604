"""What every KV transport shares: the protocols a transport implements and serves from, and
the errors it raises.

Import order (no circle): ``base`` imports nothing from ``kvtransfer``; ``wire`` and ``stream``
import ``base``; the transports import ``base``, ``wire`` and ``stream``; ``transport`` (the
registry) imports the transports lazily, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from services.engine.errors import LayoutMismatchError
from services.engine.kv_handle import KVHandle, LayoutFingerprint

if TYPE_CHECKING:
    from kvtransfer.stream import KVStream


# ---- errors -------------------------------------------------------------------------------
class TransferError(Exception):
    """A transfer was corrupt, incomplete or out of order; the KV must not be used."""


class StreamFailedError(TransferError):
    """A layer-wise stream ended without the final handle (the prefill was aborted, finished
    at its first token, or its KV hold ended before everything was sent)."""


class StreamBusyError(Exception):
    """The stream already has a receiver."""


class PermissionDeniedError(Exception):
    """A KV call for a known request without its transfer's secret, or with a wrong one
    (transports answer PERMISSION_DENIED; the sender counts it)."""


class TransportUnavailableError(RuntimeError):
    """The transport was asked for but cannot work here (e.g. NCCL without GPUs)."""


def check_layout(got: LayoutFingerprint, want: LayoutFingerprint) -> None:
    """Raises LayoutMismatchError naming every field that differs."""
    if got != want:
        raise LayoutMismatchError(f"KV layout mismatch: {got.describe_mismatch(want)}")


@dataclass(frozen=True, slots=True)
class KVTls:
    """Mutual TLS for the KV plane (grpc, shm): every replica presents ``cert`` (PEM, with
    ``key``) as server and as client, and trusts only peers signed by ``ca``. ``server_name``:
    the name the senders' certificates carry, checked instead of the dialled address (pod IPs
    are not known when certificates are issued); None checks the address itself."""

    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)
    server_name: str | None = None


# ---- the sender's side ----------------------------------------------------------------------
class KVSource(Protocol):
    """What a transport server serves from: a prefill replica's ``kvtransfer.outbox.Outbox``
    (tests and the self-test use small dict-backed ones). Called from server threads."""

    def get(self, request_id: str, secret: str) -> KVHandle | None:
        """The request's whole KV (a handle with block data) while it is held, else None.
        Raises PermissionDeniedError: ``secret`` is not the transfer's."""
        ...

    def attach(self, request_id: str, want: LayoutFingerprint, secret: str) -> KVStream:
        """Become the one receiver of the request's layer-wise stream.

        Raises:
            UnknownRequestError: no stream is open for the request here.
            PermissionDeniedError: ``secret`` is not the transfer's.
            LayoutMismatchError: ``want`` differs from the sender's layout.
            StreamBusyError: the stream already has a receiver.
        """
        ...

    def release(self, request_id: str, secret: str) -> None:
        """The receiver is done with the request's KV (placed it, or gave up); idempotent.
        Raises PermissionDeniedError: ``secret`` is not the transfer's."""
        ...


class KVServer(Protocol):
    @property
    def address(self) -> str: ...

    def stop(self, grace_s: float = 1.0) -> None: ...


# ---- the receiver's side --------------------------------------------------------------------
class KVClient(Protocol):
    def pull(
        self,
        address: str,
        request_id: str,
        layout: LayoutFingerprint,
        timeout_s: float,
        secret: str = "",
    ) -> KVHandle:
        """Fetch and verify a request's blocks; ``secret``: the transfer's (from its KVRef).

        Raises:
            UnknownRequestError: the sender does not hold the request.
            PermissionDeniedError: the sender refused ``secret``.
            LayoutMismatchError: the sender's layout differs from ``layout``.
            TransferError: corrupt, incomplete or failed transfer.
            TimeoutError: the deadline passed.
        """
        ...

    def pull_stream(
        self,
        address: str,
        request_id: str,
        layout: LayoutFingerprint,
        timeout_s: float,
        stall_s: float | None = None,
        secret: str = "",
        on_layers: Callable[[], None] | None = None,
    ) -> tuple[KVHandle, float]:
        """Receive a request's KV layer by layer while the sender prefills it (the sender
        opened the stream first); returns the handle and when the sender finished computing
        it (Unix seconds). Raises as ``pull`` does; ``StreamFailedError`` when the prefill
        ended without KV to hand over; TimeoutError when nothing came, not even a heartbeat,
        for ``stall_s`` (None: only ``timeout_s``). ``on_layers``: called once, from the
        receiving thread, when every layer is in and only the trailer is due (the decode
        replica's engine then expects the request: ``AsyncEngine.expect``)."""
        ...

    def release(
        self, address: str, request_id: str, timeout_s: float, secret: str = ""
    ) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str
    streaming: bool  # the server serves layer-wise streams (every transport does today)

    def serve(self, source: KVSource, host: str, port: int, **options: Any) -> KVServer: ...

    def client(self) -> KVClient: ...


# ---- the handoff as the gateway and the decode side see it ---------------------------------
@dataclass(frozen=True, slots=True)
class KVRef:
    """Where a request's KV is and how to take it: what a prefill replica gives the gateway and
    the gateway passes, unread, to a decode replica. ``layerwise``: a stream is open (the
    receiver attaches while the prefill runs); else the KV is held for a whole pull."""

    request_id: str
    address: str
    layerwise: bool
    # NOTE: a capability: whoever holds it may read or free this request's KV; minted per
    # transfer by the prefill side, never logged
    secret: str = field(default="", repr=False)


class KVTransferFailedError(RuntimeError):
    """Receiving a request's KV failed (``reason``: deadline, not_held, layout, denied,
    transfer); the gateway re-prefills once, then answers 503."""

    def __init__(self, message: str, reason: str = "transfer") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # NOTE: crosses Ray with its reason
        return (type(self), (str(self), self.reason))
