"""KV transfer bandwidth: every transport against raw loopback TCP in the same run, and the
transfer's share of TTFT on the default model's layout.

Each sender runs in its own process (as a prefill replica would); the receiver pulls each
payload several times over every transport in turn and keeps each one's median. Payloads are SmolLM2-135M's KV layout (30 layers,
3 KV heads, head dim 64, block 16, fp32: 46,080 bytes per token).

    OMP_NUM_THREADS=1 .venv/bin/python bench/kv_transfer_bench.py [--sizes-mb 1 4 16 64 256]
        [--transports grpc shm gloo] [--chunk-kb 2048] [--ttft | --ttft-only]
        [--ttft-transports grpc gloo]

Besides GB/s it prints each transport's CPU time per GB on both sides: on this 2-core
machine a transfer is CPU-bound, and CPU per byte is the figure that noise moves least.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvtransfer.transport import get_transport  # noqa: E402
from kvtransfer.wire import DEFAULT_CHUNK_BYTES  # noqa: E402
from services.engine.errors import UnknownRequestError  # noqa: E402
from services.engine.kv_cache import empty_bytes  # noqa: E402
from services.engine.kv_handle import KVHandle, LayoutFingerprint  # noqa: E402

LAYOUT = LayoutFingerprint("SmolLM2-135M-Instruct", 30, 3, 64, 16, "float32")
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def handle(mb: float) -> KVHandle:
    n_blocks = max(1, int(mb * (1 << 20)) // BLOCK_BYTES)
    blocks = torch.randn(30, 2, n_blocks, 16, 3, 64, generator=torch.Generator().manual_seed(1))
    n = n_blocks * 16 - 1
    return KVHandle(f"{mb}", tuple(range(n + 1)), n, LAYOUT, (), blocks)


class Source:
    """Serves fixed handles (any ``<key>#<n>`` id names the handle ``<key>``) and the
    layer-wise streams put in ``streams``."""

    def __init__(self, handles: dict[str, KVHandle]) -> None:
        self.handles = handles
        self.streams: dict[str, Any] = {}

    def get(self, request_id: str, secret: str = "") -> KVHandle | None:
        return self.handles.get(request_id.split("#")[0])

    def release(self, request_id: str, secret: str = "") -> None:
        self.streams.pop(request_id, None)

    def attach(self, request_id: str, want: LayoutFingerprint, secret: str = "") -> Any:
        stream = self.streams.get(request_id)
        if stream is None:
            raise UnknownRequestError(f"no KV stream open for request {request_id!r}")
        stream.attach()
        return stream


def serve(transport: str, sizes: list[float], chunk_bytes: int | None) -> None:
    """The sender process: prints its address, serves until stdin closes."""
    handles = {f"{mb}": handle(mb) for mb in sizes}
    server = None
    if transport == "tcp":
        payloads = {
            f"{mb}": h.blocks.view(torch.uint8).reshape(-1).numpy()
            for mb, h in zip(sizes, handles.values())
        }
        srv = socket.create_server(("127.0.0.1", 0))

        def conn(c: socket.socket) -> None:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with c, c.makefile("rb") as f:
                while hdr := f.read(64):  # a fixed 64-byte request: the payload's key
                    c.sendall(memoryview(payloads[hdr.decode().strip()]))

        def accept() -> None:
            while True:
                c, _ = srv.accept()
                threading.Thread(target=conn, args=(c,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        print(f"127.0.0.1:{srv.getsockname()[1]}", flush=True)
    elif transport == "grpc-floor":
        print(floor_server(handles, chunk_bytes or DEFAULT_CHUNK_BYTES), flush=True)
    else:
        options = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
        server = get_transport(transport).serve(Source(handles), "127.0.0.1", 0, **options)
        print(server.address, flush=True)
    sys.stdin.read()
    if server is not None:
        server.stop()  # NOTE: shm: a stopped sender unlinks its segments


def floor_server(handles: dict[str, KVHandle], chunk_bytes: int) -> str:
    """gRPC's own ceiling on this machine: a ``PullKV`` server that streams messages framed
    in advance (no copy of ours on either side; the client only iterates them), same
    options and chunk size as the real transport."""
    from concurrent import futures

    import grpc

    from kvtransfer import grpc_transport as gt
    from kvtransfer import wire
    from proto.pdserve.v1 import kv_transfer_pb2 as pb

    frames = {k: list(wire.encode(h, chunk_bytes)) for k, h in handles.items()}

    def pull(request: pb.PullKVRequest, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        yield from frames[request.request_id.split("#")[0]]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=gt._OPTIONS)
    handler = grpc.unary_stream_rpc_method_handler(
        pull, pb.PullKVRequest.FromString, wire.serialize
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(gt._SERVICE, {"PullKV": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _KEEP.append(server)
    return f"127.0.0.1:{port}"


_KEEP: list[object] = []  # the floor server lives as long as the sender process


def floor_pull(address: str, key: str) -> None:
    from kvtransfer import grpc_transport as gt
    from proto.pdserve.v1 import kv_transfer_pb2 as pb

    calls = _FLOOR_CALLS.get(address) or _FLOOR_CALLS.setdefault(address, gt._Calls(address))
    for _ in calls.pull(pb.PullKVRequest(request_id=key), timeout=120.0):
        pass


_FLOOR_CALLS: dict[str, Any] = {}  # one channel per sender, as the real client keeps


def tcp_pull(address: str, key: str, nbytes: int, sock: list[socket.socket]) -> None:
    if not sock:
        host, port = address.rsplit(":", 1)
        sock.append(socket.create_connection((host, int(port))))
    s = sock[0]
    s.sendall(f"{key:<64}".encode()[:64])
    # NOTE: an unzeroed buffer from the same pool as the transports' receivers (``empty_bytes``);
    # a bytearray would add a zeroing pass and flatter the others
    view, got = memoryview(empty_bytes(nbytes).numpy()).cast("B"), 0
    while got < nbytes:
        n = s.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the raw TCP sender closed the connection")
        got += n


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux /proc;
    10 ms ticks: sum it over many pulls)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Receiver:
    """One transport's sender process and this process's client of it."""

    def __init__(self, transport: str, sizes: list[float], chunk_kb: int | None) -> None:
        self.transport = transport
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                *("--serve", transport),
                *(("--chunk-kb", str(chunk_kb)) if chunk_kb else ()),
                *("--sizes-mb", *map(str, sizes)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.address = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        raw = transport in ("tcp", "grpc-floor")
        self.client = None if raw else get_transport(transport).client()
        self.sock: list[socket.socket] = []
        self.n = 0

    def pull(self, mb: float, nbytes: int) -> tuple[float, float, float]:
        """Seconds of one pull, and the CPU seconds it cost the receiver (this process) and
        the sender."""
        self.n += 1
        cpu, sender_cpu = time.process_time(), process_cpu_s(self.proc.pid)
        t = time.perf_counter()
        if self.transport == "grpc-floor":
            floor_pull(self.address, f"{mb}#{self.n}")
        elif self.client is None:
            tcp_pull(self.address, f"{mb}", nbytes, self.sock)
        else:
            self.client.pull(self.address, f"{mb}#{self.n}", LAYOUT, 120.0)
        dt = time.perf_counter() - t
        if self.client is not None:  # NOTE: as a decode replica does (shm reuses the segment)
            self.client.release(self.address, f"{mb}#{self.n}", 10.0)
        return dt, time.process_time() - cpu, process_cpu_s(self.proc.pid) - sender_cpu

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)


def measure(
    transports: list[str], sizes: list[float], repeats: int, chunk_kb: int | None
) -> tuple[dict[str, dict[float, float]], dict[str, dict[float, tuple[float, float]]]]:
    """GB/s (median of ``repeats``) per transport and payload, and CPU ms per GB moved
    (receiver, sender; mean over the repeats). NOTE: interleaved: every repeat pulls once
    over each transport in turn, so this machine's slow spells hit all of them alike
    (measured one after another, the same transport drifted by 2x). The CPU cost drifts far
    less than the wall time: it tells what a transport's own work costs per byte."""
    receivers = [Receiver(t, sizes, chunk_kb) for t in transports]
    try:
        out: dict[str, dict[float, float]] = {t: {} for t in transports}
        cpu: dict[str, dict[float, tuple[float, float]]] = {t: {} for t in transports}
        for mb in sizes:
            nbytes = max(1, int(mb * (1 << 20)) // BLOCK_BYTES) * BLOCK_BYTES
            runs: dict[str, list[tuple[float, float, float]]] = {t: [] for t in transports}
            for i in range(repeats + 1):  # the first round warms the connections up
                for r in receivers:
                    run = r.pull(mb, nbytes)
                    if i:
                        runs[r.transport].append(run)
            for t in transports:
                out[t][mb] = nbytes / statistics.median(dt for dt, _, _ in runs[t]) / 1e9
                gb = nbytes * len(runs[t]) / 1e9
                cpu[t][mb] = (
                    1e3 * sum(c for _, c, _ in runs[t]) / gb,
                    1e3 * sum(c for _, _, c in runs[t]) / gb,
                )
        return out, cpu
    finally:
        for r in receivers:
            r.close()


def prefill_sender(transport: str) -> None:
    """The sender process of the TTFT measurement: a real prefill engine (the default model,
    default chunking) behind the transport. Commands on stdin, one per line:
    ``<request id> <tokens> whole|stream``; it answers ``open <secret>`` once the request (and
    its stream) exists, then ``done <time.time()>`` when the first token is sampled."""
    from kvtransfer.outbox import Outbox
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = Engine.from_path(None, EngineConfig(role="prefill", num_kv_blocks=600))
    lock = threading.Lock()
    outbox = Outbox(engine.fingerprint, lambda: lock)
    server = get_transport(transport).serve(outbox, "127.0.0.1", 0)
    print(server.address, flush=True)
    for line in sys.stdin:
        rid, n, mode = line.split()
        salt = zlib.crc32(rid.encode())  # NOTE: a prompt of its own: no prefix-cache hits
        ids = [(7 * i + salt) % 40000 + 10 for i in range(int(n))]
        sink = outbox.open(rid, len(ids), stream=mode == "stream")
        with lock:
            engine.add_request(
                rid, ids, SamplingParams(max_tokens=2, ignore_eos=True), kv_sink=sink
            )
        print(f"open {sink.secret}", flush=True)  # NOTE: the KVRef's secret, as a ref carries it
        done = False
        while not done:
            with lock:  # NOTE: one step at a time, as the replica's loop thread does
                done = any(o.finished for o in engine.step() if o.request_id == rid)
        print(f"done {time.time()}", flush=True)


WARMUP_TOKENS = 2048


def ttft_share(transport: str, sizes: tuple[int, ...] = (512, 2048, 8190)) -> list[dict]:
    """Measured, not modelled: for each prompt size, the prefill's time to its first token
    and the transfer time left *after* it (the part TTFT cannot hide), with the whole KV
    pulled after the prefill and with layer-wise streaming during it."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--prefill-sender", transport],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out, inp = proc.stdout, proc.stdin
    assert out is not None and inp is not None
    try:
        address = out.readline().strip()
        client = get_transport(transport).client()
        rows = []
        # NOTE: one unreported round first: a process's first large transfer is 2-3x slower
        # (fresh memory, HTTP/2 windows growing); a serving replica is past that
        for n in (WARMUP_TOKENS, *sizes):
            row: dict = {"tokens": n, "kv_mb": n * BLOCK_BYTES / 16 / (1 << 20)}
            for mode in ("whole", "stream"):
                rid = f"{mode}-{n}-{len(rows)}"
                t0 = time.time()
                inp.write(f"{rid} {n} {mode}\n")
                inp.flush()
                opened, secret = out.readline().split()
                assert opened == "open", opened
                box: dict = {}
                if mode == "stream":

                    def receive(box: dict = box, rid: str = rid, secret: str = secret) -> None:
                        box["h"] = client.pull_stream(address, rid, LAYOUT, 600.0, secret=secret)
                        box["at"] = time.time()

                    th = threading.Thread(target=receive)
                    th.start()
                done_at = float(out.readline().split()[1])
                if mode == "whole":
                    client.pull(address, rid, LAYOUT, 120.0, secret=secret)
                    box["at"] = time.time()
                else:
                    th.join()
                client.release(address, rid, 10.0, secret=secret)
                row["prefill_s"] = done_at - t0
                row[f"{mode}_exposed_s"] = max(0.0, box["at"] - done_at)
                row[f"{mode}_share"] = row[f"{mode}_exposed_s"] / (done_at - t0)
            rows.append(row)
        client.close()
        return rows[1:]
    finally:
        inp.close()
        proc.wait(timeout=60)


def print_ttft(transport: str, rows: list[dict]) -> None:
    print(
        f"\nexposed KV transfer (after the first token) as a share of TTFT, {transport}, this CPU"
    )
    for r in rows:
        print(
            f"{r['tokens']:5d} tokens, KV {r['kv_mb']:5.0f} MB: prefill {r['prefill_s']:6.2f} s; "
            f"whole pull {1e3 * r['whole_exposed_s']:7.1f} ms ({100 * r['whole_share']:4.1f}%), "
            f"layer-wise {1e3 * r['stream_exposed_s']:7.1f} ms ({100 * r['stream_share']:4.1f}%)"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-sender", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0, 64.0, 256.0])
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["grpc", "shm", "gloo"],
        help="also grpc-floor: gRPC alone, with messages framed in advance (its ceiling here)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--chunk-kb",
        type=int,
        default=None,
        help="every sender's chunk (message) size; default: each transport's own",
    )
    ap.add_argument("--ttft", action="store_true", help="also the exposed transfer share of TTFT")
    ap.add_argument("--ttft-only", action="store_true", help="only that")
    ap.add_argument("--ttft-transports", nargs="+", default=["grpc", "gloo"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.sizes_mb, args.chunk_kb and args.chunk_kb << 10)
        return 0
    if args.prefill_sender:
        prefill_sender(args.prefill_sender)
        return 0
    if args.ttft_only:
        for t in args.ttft_transports:
            print_ttft(t, ttft_share(t))
        return 0
    results, cpu = measure(["tcp", *args.transports], args.sizes_mb, args.repeats, args.chunk_kb)
    print("GB/s by payload (ratio to raw loopback TCP in this run)")
    print("payload  " + "".join(f"{t:>18}" for t in results))
    for mb in args.sizes_mb:
        cells = []
        for t in results:
            g = results[t][mb]
            cells.append(
                f"{g:8.2f} ({g / results['tcp'][mb]:4.2f}x)" if t != "tcp" else f"{g:18.2f}"
            )
        print(f"{mb:5g} MB " + "".join(f"{c:>18}" for c in cells))
    print("\nCPU ms per GB moved, receiver + sender (each process, all its threads)")
    print("payload  " + "".join(f"{t:>18}" for t in cpu))
    for mb in args.sizes_mb:
        cells = [f"{rc:6.0f} + {sc:4.0f}" for rc, sc in (cpu[t][mb] for t in cpu)]
        print(f"{mb:5g} MB " + "".join(f"{c:>18}" for c in cells))
    out: dict[str, object] = {
        "chunk_kb": args.chunk_kb,
        "gbps": {t: {str(k): v for k, v in r.items()} for t, r in results.items()},
        "cpu_ms_per_gb": {t: {str(k): v for k, v in r.items()} for t, r in cpu.items()},
    }
    if args.ttft:
        out["ttft"] = ttft = {t: ttft_share(t) for t in args.ttft_transports}
        for t, rows in ttft.items():
            print_ttft(t, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
