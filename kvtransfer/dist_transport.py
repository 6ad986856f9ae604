"""torch.distributed KV transport: NCCL between GPUs, gloo as its CPU stand-in (same code).

Rendezvous: every prefill replica hosts a ``TCPStore`` at its KV address. A decode replica that
first pulls from an address opens a *pair* there: it takes the next pair number from the store
(``add``), announces it, and both sides build a two-rank process group (prefill rank 0, decode
rank 1) over that pair's ``PrefixStore``. Pairs are made lazily, one per (decode replica,
prefill replica), reused for every later transfer, closed when idle for ``idle_s`` and bounded
to ``max_pairs`` per decode replica (least recently used goes first).

One transfer on a pair (the pair's lock makes them sequential, so messages match in order):
1. decode: ``pair/k/q/n`` = {"op": "pull", request id, layout} in the store;
2. prefill: looks the request up; ``pair/k/r/n`` = an error, or the header (sizes, layout,
   each chunk's checksum); then sends the payload chunk by chunk over the process group;
3. decode: receives each chunk into its buffer, checks its checksum, rebuilds the handle;
   then ``{"op": "release"}`` frees the blocks on the prefill side (its hold lease frees them
   if that never comes).
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
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer import wire
from kvtransfer.transport import KVSource
from proto.pdserve.v1 import kv_transfer_pb2 as pb
from services.engine.errors import LayoutMismatchError, UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20

ChunkHook = Callable[[int, torch.Tensor], torch.Tensor]


class TransportUnavailableError(RuntimeError):
    """The transport was asked for but cannot work here (e.g. NCCL without GPUs)."""


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
        raise wire.TransferError(f"KV store: {e}") from None
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
        self._address = f"{host}:{self.store.port}"
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
        host, port = self._address.rsplit(":", 1)
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s)
        )

    def _accept(self) -> None:
        store = self._connect()
        k = 0
        while not self._stopped.is_set():
            try:
                self._wait_for(store, f"open/{k}", b"stop", 24 * 3600.0)
            except (TimeoutError, wire.TransferError):
                continue
            if self._stopped.is_set():
                return
            self._spawn(self._serve_pair, f"kv-dist-pair-{k}", k)
            k += 1

    def _serve_pair(self, k: int) -> None:
        prefix = f"pair/{k}/"
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
                    self.source.release(msg["request_id"])
                    store.set(f"{prefix}r/{n}", b'{"ok": true}')
                elif msg["op"] == "pull":
                    self._pull(pg, store, prefix, n, msg)
                n += 1
        except Exception as e:  # a dead or timed-out peer: this pair is done
            log.info("KV pair %d closed: %s", k, e)
        finally:
            with self._wlock:
                self.pairs_open -= 1

    def _pull(self, pg: Any, store: Any, prefix: str, n: int, msg: dict[str, Any]) -> None:
        handle = self.source.get(msg["request_id"])
        if handle is None:
            self._answer(store, prefix, n, {"error": "not_found", "detail": msg["request_id"]})
            return
        want = pb.KVLayout.FromString(base64.b64decode(msg["layout"]))
        try:
            wire.check_layout(handle.fingerprint, wire.layout_from_proto(want))
        except LayoutMismatchError as e:
            self._answer(store, prefix, n, {"error": "layout", "detail": str(e)})
            return
        data = wire.payload(handle).to(_device(self.backend))
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

    @staticmethod
    def _answer(store: Any, prefix: str, n: int, body: dict[str, Any]) -> None:
        store.set(f"{prefix}r/{n}", json.dumps(body).encode())


class _Pair:
    def __init__(self, address: str, backend: str, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.address = address
        self.store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.k = self.store.add("pairs", 1) - 1
        self.prefix = f"pair/{self.k}/"
        self.store.set(f"open/{self.k}", b"1")
        self.pg = _group(backend, dist.PrefixStore(self.prefix, self.store), 1, timeout_s)
        self.n = 0
        self.lock = threading.Lock()
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
    """The decode side: pairs by address, lazily made, LRU-bounded, closed when idle."""

    def __init__(
        self,
        backend: str,
        *,
        max_pairs: int = 16,
        idle_s: float = 300.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        check_backend(backend)
        self.backend, self.max_pairs, self.idle_s = backend, max_pairs, idle_s
        self.connect_timeout_s = connect_timeout_s
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()
        self._lock = threading.Lock()

    def _pair(self, address: str) -> _Pair:
        with self._lock:
            now = time.monotonic()
            for addr in [a for a, p in self._pairs.items() if now - p.last_used > self.idle_s]:
                self._pairs.pop(addr).close()
            pair = self._pairs.get(address)
            if pair is not None:
                self._pairs.move_to_end(address)
                return pair
            while len(self._pairs) >= self.max_pairs:
                self._pairs.popitem(last=False)[1].close()
        pair = _Pair(address, self.backend, self.connect_timeout_s)  # outside the lock: blocks
        with self._lock:
            self._pairs[address] = pair
        return pair

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            if self._pairs.get(pair.address) is pair:
                del self._pairs[pair.address]
        pair.close()

    @property
    def num_pairs(self) -> int:
        return len(self._pairs)

    def pull(
        self, address: str, request_id: str, layout: LayoutFingerprint, timeout_s: float
    ) -> KVHandle:
        end = time.monotonic() + timeout_s
        try:
            pair = self._pair(address)
        except Exception as e:
            raise wire.TransferError(f"KV pair with {address} did not form: {e}") from None
        with pair.lock:
            pair.last_used = time.monotonic()
            try:
                return self._receive(pair, request_id, layout, end)
            except (UnknownRequestError, LayoutMismatchError):
                raise  # answered cleanly: the pair stays usable
            except TimeoutError:
                self._drop(pair)
                raise TimeoutError(f"KV transfer from {address} passed its deadline") from None
            except wire.TransferError:
                self._drop(pair)
                raise
            except Exception as e:  # a dead peer surfaces as a gloo/NCCL runtime error
                self._drop(pair)
                raise wire.TransferError(f"KV transfer from {address} failed: {e}") from None

    def _receive(
        self, pair: _Pair, request_id: str, layout: LayoutFingerprint, end: float
    ) -> KVHandle:
        body = {
            "op": "pull",
            "request_id": request_id,
            "layout": base64.b64encode(wire.layout_to_proto(layout).SerializeToString()).decode(),
        }
        n, answer = pair.ask(body, max(0.0, end - time.monotonic()))
        if answer.get("error") == "not_found":
            raise UnknownRequestError(f"no KV held for request {request_id!r}")
        if answer.get("error") == "layout":
            raise LayoutMismatchError(answer["detail"])
        header = pb.KVHeader.FromString(base64.b64decode(answer["header"]))
        wire.check_header(header, layout)
        buf = torch.empty(header.total_bytes, dtype=torch.uint8, device=_device(self.backend))
        for seq, (a, b) in enumerate(wire.chunk_ranges(header.total_bytes, header.chunk_bytes)):
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError
            work = pair.pg.recv([buf[a:b]], 0, n)
            if not work.wait(datetime.timedelta(seconds=left)):
                raise TimeoutError
            wire.verify_chunk(header, seq, buf[a:b])
        return wire.handle_from(header, buf, layout)

    def release(self, address: str, request_id: str, timeout_s: float) -> None:
        pair = self._pair(address)
        with pair.lock:
            try:
                pair.ask({"op": "release", "request_id": request_id}, timeout_s)
            except Exception:
                self._drop(pair)
                raise

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), OrderedDict()
        for p in pairs:
            p.close()


_LIVE: weakref.WeakSet[DistKVServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=0.0)


class DistTransport:
    # NOTE: whole pulls only for now: a layer-wise stream would need a control message per
    # piece through the store; the prefill/decode flow uses ``pull`` with this transport.
    streaming = False

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
