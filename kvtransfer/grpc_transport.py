"""gRPC KV transport: a ``KVTransfer`` server per prefill replica, pulled by decode replicas.

Lifecycle of one transfer:
1. The decode side calls ``PullKV(request_id, its layout)`` with a deadline.
2. The server looks the request up in its ``KVSource``: NOT_FOUND if absent,
   FAILED_PRECONDITION if the layouts differ; else it streams a header and checksummed chunks.
3. The client verifies every chunk (``wire.decode``) and returns the handle, or raises.
4. The decode side calls ``ReleaseKV`` once the blocks are placed (or it gave up); the
   prefill side's hold timeout frees them if that never comes.

Layer-wise (``StreamKV``): the prefill replica opens a stream before it names its address; the
decode side calls ``StreamKV`` at once and gets a header (what to allocate), pieces (one layer,
a run of positions, checksummed) while the prefill runs, and a trailer (the first token, the count
of pieces) when it ends; then ``ReleaseKV`` as above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
import grpc.experimental

from kvtransfer import shm, wire
from kvtransfer.base import (
    KVSource,
    KVTls,
    PermissionDeniedError,
    StreamBusyError,
    StreamFailedError,
    TransferError,
    check_layout,
)
from kvtransfer.stream import Heartbeat
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint

# NOTE: chunks stay well under gRPC's 4 MiB default message limit; both ends also raise it.
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", 16 << 20),
]
# NOTE: the consuming thread polls its own data stream instead of being handed each message
# by the channel's spin thread: one thread switch (and GIL hand-off) less per message; the
# receiver's CPU per GB drops by about a tenth here
_CLIENT_OPTIONS = [*_OPTIONS, (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]

# test hook over every outgoing message, parsed (fault injection; slows the server down)
MessageHook = Callable[[Any], Any]
_SERVICE = "pdserve.v1.KVTransfer"


class _Servicer:
    def __init__(
        self,
        source: KVSource,
        chunk_bytes: int,
        hook: MessageHook | None,
        segments: shm.Segments | None,
    ) -> None:
        self.source = source
        self.chunk_bytes = chunk_bytes
        self.hook = hook
        self.segments = segments  # set: same-host receivers get shared memory
        self.host_id = shm.host_id() if segments is not None else ""

    def PullKV(
        self, request: pb.PullKVRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullKVResponse]:
        try:
            handle = self.source.get(request.request_id, request.secret)
        except PermissionDeniedError as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if handle is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"no KV held for request {request.request_id!r}"
            )
        try:
            check_layout(handle.fingerprint, wire.layout_from_proto(request.layout))
        except LayoutMismatchError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        chunk = min(request.max_chunk_bytes or self.chunk_bytes, self.chunk_bytes)
        if self.segments is not None and self.host_id and request.host_id == self.host_id:
            data = wire.payload_of(handle).cpu()
            name, seg = self.segments.reserve(request.request_id, data.numel())
            yield self._hooked(wire.segment_header(handle, data.numel(), chunk, name))
            for seq, (a, b) in enumerate(wire.chunk_ranges(data.numel(), chunk)):
                seg[a:b].copy_(data[a:b])  # NOTE: announced once in: the receiver copies it now
                yield self._hooked(wire.segment_notice(seq, data[a:b]))
            return
        for msg in wire.encode(handle, chunk):
            yield self._hooked(msg)

    def _hooked(self, raw: bytes, kind: type = pb.PullKVResponse) -> bytes:
        if self.hook is None:
            return raw
        return self.hook(kind.FromString(raw)).SerializeToString()  # type: ignore[attr-defined]

    def StreamKV(
        self, request: pb.StreamKVRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        want = wire.layout_from_proto(request.layout)
        try:
            stream = self.source.attach(request.request_id, want, request.secret)
        except UnknownRequestError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except PermissionDeniedError as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except LayoutMismatchError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except StreamBusyError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        yield self._hooked(
            wire.stream_header(stream.request_id, stream.fingerprint, stream.num_tokens),
            pb.StreamKVResponse,
        )
        left = context.time_remaining()
        deadline = time.monotonic() + (left if left is not None else 3600.0)
        seq = 0
        try:
            for item in stream.events(deadline, context.is_active):
                if isinstance(item, Heartbeat):
                    yield wire.STREAM_HEARTBEAT
                    continue
                if isinstance(item, KVHandle):
                    trailer = wire.stream_trailer(item, seq, stream.finished_unix)
                    yield self._hooked(trailer, pb.StreamKVResponse)
                    return
                for frame in wire.piece_frames(item, seq, self.chunk_bytes):
                    yield self._hooked(frame, pb.StreamKVResponse)
                    seq += 1
        except StreamFailedError as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))

    def ReleaseKV(
        self, request: pb.ReleaseKVRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseKVResponse:
        try:
            self.source.release(request.request_id, request.secret)
        except PermissionDeniedError as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if self.segments is not None:
            self.segments.release(request.request_id)
        return pb.ReleaseKVResponse()


class GrpcKVServer:
    """A ``KVTransfer`` server on ``host:port`` (port 0 picks a free one).

    Args:
        shared_memory: hand payloads to receivers on the same host through /dev/shm
            (transport ``shm``); a segment is the request's until release or ``lease_s``,
            then reused.
        message_hook: test hook applied to every outgoing message (fault injection).
    """

    def __init__(
        self,
        source: KVSource,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        max_workers: int = 4,
        shared_memory: bool = False,
        lease_s: float = 60.0,
        message_hook: MessageHook | None = None,
        tls: KVTls | None = None,
    ) -> None:
        self.segments = shm.Segments(lease_s) if shared_memory else None
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS
        )
        servicer = self._servicer = _Servicer(source, chunk_bytes, message_hook, self.segments)
        # NOTE: registered by hand, not with the generated helper: the data-carrying streams
        # send bytes framed by ``wire`` (one copy) instead of protobuf messages.
        handlers = {
            "PullKV": grpc.unary_stream_rpc_method_handler(
                servicer.PullKV, pb.PullKVRequest.FromString, wire.serialize
            ),
            "StreamKV": grpc.unary_stream_rpc_method_handler(
                servicer.StreamKV, pb.StreamKVRequest.FromString, wire.serialize
            ),
            "ReleaseKV": grpc.unary_unary_rpc_method_handler(
                servicer.ReleaseKV,
                pb.ReleaseKVRequest.FromString,
                pb.ReleaseKVResponse.SerializeToString,
            ),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, handlers),)
        )
        if tls is None:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        else:  # NOTE: mutual: a receiver without a certificate signed by the CA gets nothing
            creds = grpc.ssl_server_credentials(
                [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
            )
            bound = self._server.add_secure_port(f"{host}:{port}", creds)
        if bound == 0:
            raise OSError(f"cannot bind the KV transfer server to {host}:{port}")
        self._address = f"{host}:{bound}"
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    def set_message_hook(self, hook: MessageHook | None) -> None:
        """Install (or remove: None) the fault-injection hook on a running server."""
        self._servicer.hook = hook

    def stop(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait(grace_s + 1.0)
        if self.segments is not None:
            self.segments.close()


class _Calls:
    """One channel to a sender and its three calls (made once: building a multicallable
    costs more than a small pull)."""

    def __init__(self, address: str, tls: KVTls | None) -> None:
        if tls is None:
            self.channel = grpc.insecure_channel(address, options=_CLIENT_OPTIONS)
        else:
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            name = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
            self.channel = grpc.secure_channel(address, creds, options=[*_CLIENT_OPTIONS, *name])
        # NOTE: no response deserializer on the data streams: ``wire`` reads the raw frames
        # without a copy
        self.pull = self.channel.unary_stream(
            f"/{_SERVICE}/PullKV", pb.PullKVRequest.SerializeToString, None
        )
        self.stream = self.channel.unary_stream(
            f"/{_SERVICE}/StreamKV", pb.StreamKVRequest.SerializeToString, None
        )
        self.release = self.channel.unary_unary(
            f"/{_SERVICE}/ReleaseKV",
            pb.ReleaseKVRequest.SerializeToString,
            pb.ReleaseKVResponse.FromString,
        )


class GrpcKVClient:
    """Pulls KV blocks from ``GrpcKVServer``s; keeps one channel per address.

    Args:
        shared_memory: offer same-host handover (the server uses it when it shares /dev/shm).
    """

    def __init__(self, shared_memory: bool = False, tls: KVTls | None = None) -> None:
        self.tls = tls
        self._calls: dict[str, _Calls] = {}
        self._lock = threading.Lock()
        self.host_id = shm.host_id() if shared_memory else ""
        self._segments = shm.SegmentReader() if shared_memory else None

    def _to(self, address: str) -> _Calls:
        with self._lock:
            calls = self._calls.get(address)
            if calls is None:
                calls = self._calls[address] = _Calls(address, self.tls)
            return calls

    def pull(
        self,
        address: str,
        request_id: str,
        layout: LayoutFingerprint,
        timeout_s: float,
        secret: str = "",
    ) -> KVHandle:
        req = pb.PullKVRequest(
            request_id=request_id,
            layout=wire.layout_to_proto(layout),
            host_id=self.host_id,
            secret=secret,
        )
        try:
            call = self._to(address).pull(req, timeout=timeout_s)
            return wire.decode(call, layout, self._segments)
        except grpc.RpcError as e:
            raise _map_error(e, address) from None

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
        """Receive a request's KV layer by layer while it is prefilled; returns the handle
        and the sender's ``finished_unix``. Raises as ``pull`` does."""
        req = pb.StreamKVRequest(
            request_id=request_id, layout=wire.layout_to_proto(layout), secret=secret
        )
        call = self._to(address).stream(req, timeout=timeout_s)
        watch = StallWatch(stall_s, call.cancel)
        try:
            with watch:
                return wire.decode_stream(watch.messages(call), layout, on_layers)
        except grpc.RpcError as e:
            if watch.stalled:
                raise watch.error(address) from None
            raise _map_error(e, address) from None

    def release(self, address: str, request_id: str, timeout_s: float, secret: str = "") -> None:
        try:
            self._to(address).release(
                pb.ReleaseKVRequest(request_id=request_id, secret=secret), timeout=timeout_s
            )
        except grpc.RpcError as e:
            raise _map_error(e, address) from None

    def close(self) -> None:
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for c in calls:
            c.channel.close()
        if self._segments is not None:
            self._segments.close()


class StallWatch:
    """Cancels a receive (``cancel``) when no message came for ``stall_s`` (None: never):
    a context manager around the read; ``messages`` marks each arrival."""

    def __init__(self, stall_s: float | None, cancel: Callable[[], object]) -> None:
        self.stall_s = stall_s
        self.stalled = False
        self._cancel = cancel
        self._last = time.monotonic()
        self._done = threading.Event()

    def messages(self, it: Iterable[bytes]) -> Iterator[bytes]:
        for m in it:
            self._last = time.monotonic()
            yield m

    def error(self, address: str) -> TimeoutError:
        return TimeoutError(f"the KV stream from {address} made no progress for {self.stall_s} s")

    def _watch(self) -> None:
        assert self.stall_s is not None
        while not self._done.wait(min(1.0, self.stall_s / 4)):
            if time.monotonic() - self._last > self.stall_s:
                self.stalled = True
                self._cancel()
                return

    def __enter__(self) -> StallWatch:
        if self.stall_s is not None:
            threading.Thread(target=self._watch, name="kv-stall-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()


def _map_error(e: grpc.RpcError, address: str) -> Exception:
    code, details = e.code(), e.details()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownRequestError(details)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return LayoutMismatchError(details)
    if code == grpc.StatusCode.ABORTED:
        return StreamFailedError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"KV transfer from {address} passed its deadline")
    return TransferError(f"KV transfer from {address} failed: {code.name}: {details}")


class GrpcTransport:
    """``grpc``: streamed chunks. ``shm`` (``shared_memory=True``): the same, except that a
    receiver sharing the sender's /dev/shm gets a whole payload through a shared segment
    (layer-wise streams travel as gRPC messages with either)."""

    streaming = True  # layer-wise streams (StreamKV)

    def __init__(self, shared_memory: bool = False, tls: KVTls | None = None) -> None:
        self.shared_memory = shared_memory
        self.tls = tls
        self.name = "shm" if shared_memory else "grpc"

    def serve(
        self, source: KVSource, host: str = "127.0.0.1", port: int = 0, **options: Any
    ) -> GrpcKVServer:
        return GrpcKVServer(
            source, host, port, shared_memory=self.shared_memory, tls=self.tls, **options
        )

    def client(self) -> GrpcKVClient:
        return GrpcKVClient(shared_memory=self.shared_memory, tls=self.tls)
