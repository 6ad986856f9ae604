"""torch.distributed KV transport: NCCL between GPUs, gloo as its CPU stand-in (same code).

Rendezvous: every prefill replica hosts a ``TCPStore`` at its KV address, which ends in a random
namespace (``host:port/<128-bit hex>``) that prefixes every key: a TCPStore has no access control
and no way to list keys, so who reaches the port without the address (it travels only in
``KVRef``s) cannot find a pair's keys, and every request carries its transfer's secret besides
(checked by the Outbox). A decode replica that first pulls from an address opens a *pair* there: it takes the next pair number from the store
(``add``), announces it, and both sides build a two-rank process group (prefill rank 0, decode
rank 1) over that pair's ``PrefixStore``. Pairs are made lazily, reused for later transfers,
closed when idle for ``idle_s``, at most ``pairs_per_peer`` to one prefill replica (a pair
carries one transfer at a time) and ``max_pairs`` in all per decode replica (the least
recently used idle pair goes first).

One transfer on a pair (sequential on it, so messages match in order):
1. decode: ``<ns>/pair/k/q/n`` = {"op": "pull", request id, layout, secret} in the store;
2. prefill: looks the request up; ``<ns>/pair/k/r/n`` = an error, or the header (sizes, layout,
   each chunk's checksum); then sends the payload chunk by chunk over the process group;
3. decode: receives each chunk into its buffer, checks its checksum, rebuilds the handle;
   then ``{"op": "release"}`` frees the blocks on the prefill side (its hold lease frees them
   if that never comes).
Layer-wise (``{"op": "stream"}``, sent as soon as the prefill replica names its open stream):
the answer is the stream header (what to allocate); then, while the prefill runs, a small
meta tensor per message (piece: layer, positions, size, checksum; or the end, or why it
failed) followed by its bytes over the group: a piece's KV, the trailer, or the reason.
Any failure (deadline, a dead peer, a bad chunk) closes the pair: a half-read stream would
shift every later message, so the next pull opens a fresh one.

``nccl`` needs CUDA on both sides: asked for without it, the transport refuses at start.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime
import json
import logging
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer import wire
from kvtransfer.base import (
    KVSource,
    PermissionDeniedError,
    StreamBusyError,
    StreamFailedError,
    TransferError,
    TransportUnavailableError,
    check_layout,
)
from kvtransfer.stream import Heartbeat
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.kv_cache import empty_bytes
from services.engine.kv_handle import KVHandle, LayoutFingerprint

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20

ChunkHook = Callable[[int, torch.Tensor], torch.Tensor]

# A layer-wise stream's messages over the group: a ``_meta`` tensor, then its bytes.
# what the bytes are (a piece, the trailer, why it ended; a heartbeat carries none)
_PIECE, _END, _FAILED, _TIMED_OUT, _ALIVE = 1, 2, 3, 4, 5
_META_LEN = 7  # what, seq, layer, token_start, token_end, nbytes, checksum


def _meta(what: int, seq: int, layer: int, a: int, b: int, nbytes: int, check: int) -> torch.Tensor:
    # NOTE: checksums are unsigned 64-bit; the tensor is int64 (two's complement round trip)
    signed = check - (1 << 64) if check >= 1 << 63 else check
    return torch.tensor([what, seq, layer, a, b, nbytes, signed], dtype=torch.int64)


def check_backend(backend: str) -> None:
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise TransportUnavailableError("KV transport gloo: torch was built without gloo")
    elif backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise TransportUnavailableError(
                "KV transport nccl needs CUDA GPUs and torch built with NCCL; this process has "
                f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()} "
                "(use kv_transport: gloo or grpc on CPU)"
            )
    else:
        raise TransportUnavailableError(f"unknown torch.distributed backend {backend!r}")


def _group(backend: str, store: Any, rank: int, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _wait(store: Any, key: str, timeout_s: float) -> bytes:
    """The value at ``key`` once it is set (then the key is deleted); TimeoutError after
    ``timeout_s``. NOTE: one blocking wait, no polling; a stopping server wakes its own
    waiters by setting the keys they wait on."""
    try:
        store.wait([key], datetime.timedelta(seconds=max(0.001, timeout_s)))
    except dist.DistStoreError as e:
        if "timeout" in str(e).lower():
            raise TimeoutError(f"no {key!r} in the KV store within {timeout_s:.1f}s") from None
        raise TransferError(f"KV store: {e}") from None
    value = store.get(key)
    store.delete_key(key)
    return value


def _device(backend: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


class DistKVServer:
    """The prefill side: a TCPStore at ``host:port`` and one thread per open pair.

    Args:
        chunk_hook: test hook applied to every outgoing chunk (fault injection).
    """

    def __init__(
        self,
        source: KVSource,
        host: str,
        port: int,
        backend: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 30.0,
        lease_s: float = 60.0,
        chunk_hook: ChunkHook | None = None,
    ) -> None:
        # NOTE: lease_s is the engine's: held KV the receiver never released is freed by the
        # prefill engine's hold lease (the payload never leaves the engine here)
        del lease_s
        check_backend(backend)
        self.source, self.backend, self.chunk_bytes = source, backend, chunk_bytes
        self.timeout_s, self.chunk_hook = timeout_s, chunk_hook
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        self._ns = secrets.token_hex(16)  # NOTE: the keys' namespace; see the module's note
        self._hostport = f"{host}:{self.store.port}"
        self._address = f"{self._hostport}/{self._ns}"
        self._stopped = threading.Event()
        self.pairs_open = 0
        self._threads: list[threading.Thread] = []
        self._waiting: dict[str, bytes] = {}  # key a thread waits on -> what wakes it at stop
        self._wlock = threading.Lock()
        self._spawn(self._accept, "kv-dist-accept")
        _LIVE.add(self)

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        th = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [th]
        th.start()

    @property
    def address(self) -> str:
        return self._address

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting and end every pair, then join the threads. NOTE: a thread still
        inside a C++ store wait at interpreter exit aborts the process, so stop() wakes every
        waiter (it sets the keys they wait on) and joins, and an atexit hook stops whatever
        was left running."""
        self._stopped.set()
        with self._wlock:
            wake = dict(self._waiting)
        store = self._connect()
        for key, value in wake.items():
            store.set(key, value)
        for th in list(self._threads):
            th.join(timeout=grace_s + 2.0)

    def _wait_for(self, store: Any, key: str, wake: bytes, timeout_s: float) -> bytes:
        with self._wlock:
            self._waiting[key] = wake
        try:
            return _wait(store, key, timeout_s)
        finally:
            with self._wlock:
                self._waiting.pop(key, None)

    def _connect(self) -> Any:
        # NOTE: one store connection per thread: a TCPStore object serialises its calls, so
        # a thread parked in wait() would hold up every other thread's set/get behind it
        host, port = self._hostport.rsplit(":", 1)
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s)
        )

    def _accept(self) -> None:
        store = self._connect()
        k = 0
        while not self._stopped.is_set():
            try:
                self._wait_for(store, f"{self._ns}/open/{k}", b"stop", 24 * 3600.0)
            except (TimeoutError, TransferError):
                continue
            if self._stopped.is_set():
                return
            self._spawn(self._serve_pair, f"kv-dist-pair-{k}", k)
            k += 1

    def _serve_pair(self, k: int) -> None:
        prefix = f"{self._ns}/pair/{k}/"
        store = self._connect()
        try:
            pg = _group(self.backend, dist.PrefixStore(prefix, store), 0, self.timeout_s)
        except Exception as e:  # the decode side went away before the group formed
            log.warning("KV pair %d did not form: %s", k, e)
            return
        with self._wlock:
            self.pairs_open += 1
        try:
            n = 0
            while not self._stopped.is_set():
                try:
                    raw = self._wait_for(store, f"{prefix}q/{n}", b'{"op": "close"}', 24 * 3600.0)
                    msg = json.loads(raw)
                except TimeoutError:
                    return
                if msg["op"] == "close":
                    return
                if msg["op"] == "release":
                    try:
                        self.source.release(msg["request_id"], msg.get("secret", ""))
                        store.set(f"{prefix}r/{n}", b'{"ok": true}')
                    except PermissionDeniedError as e:
                        self._answer(store, prefix, n, {"error": "denied", "detail": str(e)})
                elif msg["op"] == "pull":
                    self._pull(pg, store, prefix, n, msg)
                elif msg["op"] == "stream":
                    self._stream(pg, store, prefix, n, msg)
                n += 1
        except Exception as e:  # a dead or timed-out peer: this pair is done
            log.info("KV pair %d closed: %s", k, e)
        finally:
            with self._wlock:
                self.pairs_open -= 1

    def _pull(self, pg: Any, store: Any, prefix: str, n: int, msg: dict[str, Any]) -> None:
        try:
            handle = self.source.get(msg["request_id"], msg.get("secret", ""))
        except PermissionDeniedError as e:
            self._answer(store, prefix, n, {"error": "denied", "detail": str(e)})
            return
        if handle is None:
            self._answer(store, prefix, n, {"error": "not_found", "detail": msg["request_id"]})
            return
        want = pb.KVLayout.FromString(base64.b64decode(msg["layout"]))
        try:
            check_layout(handle.fingerprint, wire.layout_from_proto(want))
        except LayoutMismatchError as e:
            self._answer(store, prefix, n, {"error": "layout", "detail": str(e)})
            return
        data = wire.payload_of(handle).to(_device(self.backend))
        chunk = min(int(msg.get("max_chunk_bytes") or self.chunk_bytes), self.chunk_bytes)
        header = wire.header_for(handle, data, chunk)
        self._answer(
            store, prefix, n, {"header": base64.b64encode(header.SerializeToString()).decode()}
        )
        for seq, (a, b) in enumerate(wire.chunk_ranges(data.numel(), chunk)):
            part = data[a:b]
            if self.chunk_hook is not None:
                part = self.chunk_hook(seq, part)
            pg.send([part], 1, n).wait()

    def _stream(self, pg: Any, store: Any, prefix: str, n: int, msg: dict[str, Any]) -> None:
        """A layer-wise stream: the answer names what to allocate, then one ``_meta`` and
        (for a piece) its data per message over the group, until the end or a failure."""
        rid = msg["request_id"]
        want = wire.layout_from_proto(pb.KVLayout.FromString(base64.b64decode(msg["layout"])))
        try:
            stream = self.source.attach(rid, want, msg.get("secret", ""))
        except UnknownRequestError:
            self._answer(store, prefix, n, {"error": "not_found", "detail": rid})
            return
        except PermissionDeniedError as e:
            self._answer(store, prefix, n, {"error": "denied", "detail": str(e)})
            return
        except LayoutMismatchError as e:
            self._answer(store, prefix, n, {"error": "layout", "detail": str(e)})
            return
        except StreamBusyError as e:
            self._answer(store, prefix, n, {"error": "busy", "detail": str(e)})
            return
        device = _device(self.backend)
        kind = wire.host_checksum_kind() if device.type == "cpu" else "sum64"
        header = wire.stream_header(stream.request_id, stream.fingerprint, stream.num_tokens)
        self._answer(
            store, prefix, n, {"header": base64.b64encode(header).decode(), "checksum": kind}
        )
        closed = f"{prefix}q/{n + 1}"  # NOTE: a receiver that gives up closes the pair there
        deadline = time.monotonic() + float(msg.get("timeout_s") or self.timeout_s)
        seq = 0

        def alive() -> bool:
            return not self._stopped.is_set() and not store.check([closed])

        try:
            # NOTE: a stop ends the stream whether pieces are flowing or it is waiting for one;
            # the receiver learns at once, not at its deadline
            for item in stream.events(deadline, alive):
                if self._stopped.is_set():
                    break
                if isinstance(item, Heartbeat):
                    pg.send([_meta(_ALIVE, 0, 0, 0, 0, 0, 0).to(device)], 1, n).wait()
                    continue
                if isinstance(item, KVHandle):
                    trailer = wire.stream_trailer(item, seq, stream.finished_unix)
                    self._send_bytes(pg, n, _END, trailer)
                    return
                for a, b, part in wire.piece_parts(item, self.chunk_bytes):
                    part = part.to(device)
                    sent = self.chunk_hook(seq, part) if self.chunk_hook is not None else part
                    meta = _meta(
                        _PIECE, seq, item.layer, a, b, part.numel(), wire.checksum(kind, part)
                    )
                    pg.send([meta.to(device)], 1, n).wait()
                    pg.send([sent], 1, n).wait()
                    seq += 1
            if self._stopped.is_set():
                raise StreamFailedError("the prefill replica's KV server stopped")
        except StreamFailedError as e:
            self._send_bytes(pg, n, _FAILED, str(e).encode())
        except TimeoutError as e:
            self._send_bytes(pg, n, _TIMED_OUT, str(e).encode())

    def _send_bytes(self, pg: Any, n: int, what: int, raw: bytes) -> None:
        device = _device(self.backend)
        pg.send([_meta(what, 0, 0, 0, 0, len(raw), 0).to(device)], 1, n).wait()
        if raw:
            pg.send([torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)], 1, n).wait()

    @staticmethod
    def _answer(store: Any, prefix: str, n: int, body: dict[str, Any]) -> None:
        store.set(f"{prefix}r/{n}", json.dumps(body).encode())


class _Pair:
    def __init__(self, address: str, backend: str, timeout_s: float) -> None:
        hostport, _, ns = address.partition("/")
        host, port = hostport.rsplit(":", 1)
        self.address = address
        self.store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.k = self.store.add(f"{ns}/pairs", 1) - 1
        self.prefix = f"{ns}/pair/{self.k}/"
        self.store.set(f"{ns}/open/{self.k}", b"1")
        self.pg = _group(backend, dist.PrefixStore(self.prefix, self.store), 1, timeout_s)
        self.n = 0
        self.last_used = time.monotonic()

    def ask(self, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
        n = self.n
        self.n += 1
        self.store.set(f"{self.prefix}q/{n}", json.dumps(body).encode())
        return n, json.loads(_wait(self.store, f"{self.prefix}r/{n}", timeout_s))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the server is gone already
            self.store.set(f"{self.prefix}q/{self.n}", b'{"op": "close"}')
        self.pg = None


class DistKVClient:
    """The decode side: pairs by address, lazily made, reused, closed when idle.

    A pair carries one transfer at a time; a layer-wise stream holds its pair for the whole
    prefill, so up to ``pairs_per_peer`` pairs are opened to one address (more concurrent
    transfers wait for one to free up). ``max_pairs`` bounds the pairs of this client in all;
    the least recently used idle pair goes first.
    """

    def __init__(
        self,
        backend: str,
        *,
        max_pairs: int = 32,
        pairs_per_peer: int = 8,
        idle_s: float = 300.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        check_backend(backend)
        self.backend, self.max_pairs, self.idle_s = backend, max_pairs, idle_s
        self.pairs_per_peer = max(1, min(pairs_per_peer, max_pairs))
        self.connect_timeout_s = connect_timeout_s
        self._idle: OrderedDict[_Pair, None] = OrderedDict()  # free pairs, least recent first
        self._count: dict[str, int] = {}  # pairs (busy, idle or forming) by address
        self._waiters = 0  # transfers waiting for a pair to free up
        self._cond = threading.Condition()

    @property
    def num_pairs(self) -> int:
        with self._cond:
            return sum(self._count.values())

    @property
    def transfers_waiting(self) -> int:
        """Transfers waiting for a pair (every one their peer may have is busy)."""
        with self._cond:
            return self._waiters

    @contextlib.contextmanager
    def _use(self, address: str, end: float) -> Iterator[_Pair]:
        """A pair to ``address`` for one transfer: an idle one, a new one, or the first to
        free up before ``end``. A transfer that fails in a way that may leave messages in
        flight must ``_drop`` it (then it is not returned to the idle set)."""
        pair = self._acquire(address, end)
        try:
            yield pair
        finally:
            with self._cond:
                if pair.pg is not None:  # not dropped
                    pair.last_used = time.monotonic()
                    self._idle[pair] = None
                self._cond.notify_all()

    def _acquire(self, address: str, end: float) -> _Pair:
        close: list[_Pair] = []
        waited = False
        try:
            with self._cond:
                while True:
                    now = time.monotonic()
                    for p in [p for p in self._idle if now - p.last_used > self.idle_s]:
                        close.append(self._forget(p))
                    pair = next((p for p in reversed(self._idle) if p.address == address), None)
                    if pair is not None:
                        del self._idle[pair]
                        return pair
                    if self._count.get(address, 0) < self.pairs_per_peer:
                        while sum(self._count.values()) >= self.max_pairs and self._idle:
                            close.append(self._forget(next(iter(self._idle))))
                        if sum(self._count.values()) < self.max_pairs:
                            self._count[address] = self._count.get(address, 0) + 1
                            break
                    if now >= end:
                        raise TimeoutError(f"no free KV pair to {address} before the deadline")
                    if not waited:
                        waited = True
                        self._waiters += 1
                    self._cond.wait(min(end - now, 1.0))
        finally:
            if waited:
                with self._cond:
                    self._waiters -= 1
            for p in close:
                p.close()
        try:  # NOTE: outside the lock: forming a group blocks until the peer joins
            return _Pair(address, self.backend, self.connect_timeout_s)
        except Exception as e:
            with self._cond:
                self._uncount(address)
            raise TransferError(f"KV pair with {address} did not form: {e}") from None

    def _uncount(self, address: str) -> None:
        """Under the lock: one pair to ``address`` fewer (a waiting transfer may open one)."""
        self._count[address] -= 1
        if not self._count[address]:
            del self._count[address]
        self._cond.notify_all()

    def _forget(self, pair: _Pair) -> _Pair:
        """Under the lock: take an idle ``pair`` out of the books (the caller closes it)."""
        del self._idle[pair]
        self._uncount(pair.address)
        return pair

    def _drop(self, pair: _Pair) -> None:
        """A pair in use that must not carry another transfer (a half-read message stream
        would shift every later one): close it; the next transfer opens a fresh one."""
        with self._cond:
            self._uncount(pair.address)
        pair.close()

    def _transfer(self, address: str, end: float, run: Callable[[_Pair], Any]) -> Any:
        with self._use(address, end) as pair:
            try:
                return run(pair)
            except (
                UnknownRequestError,
                LayoutMismatchError,
                StreamFailedError,
                StreamBusyError,
                PermissionDeniedError,
            ):
                raise  # answered cleanly: the pair stays usable
            except TimeoutError as e:
                self._drop(pair)  # NOTE: the sender may still write into it
                if isinstance(e, _StalledError):
                    raise TimeoutError(
                        f"the KV stream from {address} made no progress for {e} s"
                    ) from None
                raise TimeoutError(f"KV transfer from {address} passed its deadline") from None
            except TransferError:
                self._drop(pair)
                raise
            except Exception as e:  # a dead peer surfaces as a gloo/NCCL runtime error
                self._drop(pair)
                raise TransferError(f"KV transfer from {address} failed: {e}") from None

    def pull(
        self,
        address: str,
        request_id: str,
        layout: LayoutFingerprint,
        timeout_s: float,
        secret: str = "",
    ) -> KVHandle:
        end = time.monotonic() + timeout_s
        return self._transfer(
            address, end, lambda p: self._receive(p, request_id, layout, end, secret)
        )

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
        """Receive a request's KV layer by layer while the sender prefills it; returns the
        handle and the sender's ``finished_unix``. Raises as ``pull`` does; a second
        receiver gets a TransferError, a prefill that ended without KV StreamFailedError;
        nothing (not even a heartbeat) for ``stall_s``: TimeoutError."""
        end = time.monotonic() + timeout_s
        try:
            return self._transfer(
                address,
                end,
                lambda p: self._receive_stream(
                    p, request_id, layout, end, stall_s, secret, on_layers
                ),
            )
        except StreamBusyError as e:
            raise TransferError(str(e)) from None

    def _ask(
        self,
        pair: _Pair,
        op: str,
        request_id: str,
        layout: LayoutFingerprint,
        end: float,
        secret: str,
    ) -> tuple[int, dict[str, Any]]:
        body = {
            "op": op,
            "request_id": request_id,
            "secret": secret,
            "layout": base64.b64encode(wire.layout_to_proto(layout).SerializeToString()).decode(),
            "timeout_s": max(0.0, end - time.monotonic()),
        }
        n, answer = pair.ask(body, max(0.0, end - time.monotonic()))
        error = answer.get("error")
        if error == "not_found":
            what = "KV stream open" if op == "stream" else "KV held"
            raise UnknownRequestError(f"no {what} for request {request_id!r}")
        if error == "layout":
            raise LayoutMismatchError(answer["detail"])
        if error == "denied":
            raise PermissionDeniedError(answer["detail"])
        if error == "busy":
            raise StreamBusyError(answer["detail"])
        return n, answer

    def _receive(
        self, pair: _Pair, request_id: str, layout: LayoutFingerprint, end: float, secret: str
    ) -> KVHandle:
        n, answer = self._ask(pair, "pull", request_id, layout, end, secret)
        header = pb.KVHeader.FromString(base64.b64decode(answer["header"]))
        wire.check_header(header, layout)
        buf = empty_bytes(header.total_bytes, _device(self.backend))
        for seq, (a, b) in enumerate(wire.chunk_ranges(header.total_bytes, header.chunk_bytes)):
            _recv(pair, buf[a:b], n, end)
            wire.verify_chunk(header, seq, buf[a:b])
        return wire.handle_from(header, buf, layout)

    def _receive_stream(
        self,
        pair: _Pair,
        request_id: str,
        layout: LayoutFingerprint,
        end: float,
        stall_s: float | None,
        secret: str,
        on_layers: Callable[[], None] | None,
    ) -> tuple[KVHandle, float]:
        n, answer = self._ask(pair, "stream", request_id, layout, end, secret)
        first = pb.StreamKVResponse.FromString(base64.b64decode(answer["header"]))
        device = _device(self.backend)
        asm = wire.StreamAssembler(first.header, layout, device, on_layers)
        kind = answer["checksum"]
        meta = torch.empty(_META_LEN, dtype=torch.int64, device=device)
        while True:
            by = end if stall_s is None else min(end, time.monotonic() + stall_s)
            try:
                _recv(pair, meta, n, by)
            except TimeoutError:
                if by < end:
                    raise _StalledError(stall_s) from None
                raise
            what, seq, layer, a, b, nbytes, check = meta.tolist()
            if what == _ALIVE:
                continue
            if what == _PIECE:
                asm.check(seq, layer, a, b, nbytes)
                part = empty_bytes(nbytes, device)
                _recv(pair, part, n, end)
                if wire.checksum(kind, part) != check & 0xFFFF_FFFF_FFFF_FFFF:
                    raise TransferError(f"piece {seq} failed its {kind} check")
                asm.place(layer, a, b, part)
                continue
            if what not in (_END, _FAILED, _TIMED_OUT) or not 0 <= nbytes <= 1 << 20:
                raise TransferError(f"malformed stream message {what}")
            raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if nbytes:
                _recv(pair, raw, n, end)
            body = raw.cpu().numpy().tobytes()
            if what == _FAILED:
                raise StreamFailedError(body.decode(errors="replace"))
            if what == _TIMED_OUT:
                raise TimeoutError(body.decode(errors="replace"))
            msg = pb.StreamKVResponse.FromString(body)
            if msg.WhichOneof("msg") != "trailer":
                raise TransferError("the stream did not end with its trailer")
            return asm.finish(msg.trailer)

    def release(self, address: str, request_id: str, timeout_s: float, secret: str = "") -> None:
        end = time.monotonic() + timeout_s

        def run(pair: _Pair) -> None:
            body = {"op": "release", "request_id": request_id, "secret": secret}
            _, answer = pair.ask(body, max(0.0, end - time.monotonic()))
            if answer.get("error") == "denied":
                raise PermissionDeniedError(answer["detail"])

        self._transfer(address, end, run)

    def close(self) -> None:
        with self._cond:
            pairs = list(self._idle)
            for p in pairs:
                self._forget(p)
        for p in pairs:
            p.close()


class _StalledError(TimeoutError):
    """Nothing came on a stream for its stall timeout (the argument)."""


def _recv(pair: _Pair, into: torch.Tensor, tag: int, end: float) -> None:
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError
    try:
        done = pair.pg.recv([into], 0, tag).wait(datetime.timedelta(seconds=left))
    except RuntimeError as e:
        # NOTE: gloo raises (rather than returning False) when the wait times out
        if "timed out" in str(e).lower():
            raise TimeoutError from None
        raise
    if not done:
        raise TimeoutError


_LIVE: weakref.WeakSet[DistKVServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=0.0)


class DistTransport:
    streaming = True  # layer-wise streams: the ``stream`` op, pieces over the pair's group

    def __init__(self, backend: str) -> None:
        self.name = backend
        self.backend = backend
        check_backend(backend)  # NOTE: fail at start, never fall back silently

    def serve(
        self, source: KVSource, host: str = "127.0.0.1", port: int = 0, **options: Any
    ) -> DistKVServer:
        return DistKVServer(source, host, port, self.backend, **options)

    def client(self) -> DistKVClient:
        return DistKVClient(self.backend)
