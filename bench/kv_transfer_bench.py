"""KV transfer bandwidth: every transport against raw loopback TCP in the same run, and the
transfer's share of TTFT on the default model's layout.

The sender runs in its own process (as a prefill replica would); the receiver pulls each
payload several times and keeps the median. Payloads are SmolLM2-135M's KV layout (30 layers,
3 KV heads, head dim 64, block 16, fp32: 46,080 bytes per token).

    OMP_NUM_THREADS=1 .venv/bin/python bench/kv_transfer_bench.py [--sizes-mb 1 4 16 64 256]
        [--transports grpc shm gloo] [--ttft]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvtransfer.transport import get_transport  # noqa: E402
from services.engine.kv_handle import KVHandle, LayoutFingerprint  # noqa: E402

LAYOUT = LayoutFingerprint("SmolLM2-135M-Instruct", 30, 3, 64, 16, "float32")
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def handle(mb: float) -> KVHandle:
    n_blocks = max(1, int(mb * (1 << 20)) // BLOCK_BYTES)
    blocks = torch.randn(30, 2, n_blocks, 16, 3, 64, generator=torch.Generator().manual_seed(1))
    n = n_blocks * 16 - 1
    return KVHandle(f"{mb}", tuple(range(n + 1)), n, LAYOUT, (), blocks)


class Source:
    def __init__(self, handles: dict[str, KVHandle]) -> None:
        self.handles = handles

    def get(self, request_id: str) -> KVHandle | None:
        return self.handles.get(request_id.split("#")[0])

    def release(self, request_id: str) -> None:
        pass


def serve(transport: str, sizes: list[float]) -> None:
    """The sender process: prints its address, serves until stdin closes."""
    handles = {f"{mb}": handle(mb) for mb in sizes}
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
    else:
        server = get_transport(transport).serve(Source(handles), "127.0.0.1", 0)
        print(server.address, flush=True)
    sys.stdin.read()


def tcp_pull(address: str, key: str, nbytes: int, sock: list[socket.socket]) -> None:
    if not sock:
        host, port = address.rsplit(":", 1)
        sock.append(socket.create_connection((host, int(port))))
    s = sock[0]
    s.sendall(f"{key:<64}".encode()[:64])
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = s.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the raw TCP sender closed the connection")
        got += n


def measure(transport: str, sizes: list[float], repeats: int) -> dict[float, float]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", transport, "--sizes-mb", *map(str, sizes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        address = proc.stdout.readline().strip()  # type: ignore[union-attr]
        out: dict[float, float] = {}
        client = None if transport == "tcp" else get_transport(transport).client()
        sock: list[socket.socket] = []
        for mb in sizes:
            nbytes = max(1, int(mb * (1 << 20)) // BLOCK_BYTES) * BLOCK_BYTES
            times = []
            for i in range(repeats + 1):  # the first one warms the connection up
                t = time.perf_counter()
                if client is None:
                    tcp_pull(address, f"{mb}", nbytes, sock)
                else:
                    client.pull(address, f"{mb}#{i}", LAYOUT, 120.0)
                if i:
                    times.append(time.perf_counter() - t)
            out[mb] = nbytes / statistics.median(times) / 1e9
        if client is not None:
            client.close()
        return out
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)


def ttft_share(gbps: dict[str, float]) -> list[dict[str, float]]:
    """Prefill time of the real engine for 512/2048/8192-token prompts vs each transport's
    transfer time of that prompt's KV (at its measured large-payload bandwidth)."""
    from services.engine.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = Engine.from_path(None, EngineConfig(num_kv_blocks=600, max_num_batched_tokens=8192))
    rows = []
    for n in (512, 2048, 8191):
        t = time.perf_counter()
        engine.generate([[(7 * i) % 40000 + 10 for i in range(n)]], SamplingParams(max_tokens=1))
        prefill_s = time.perf_counter() - t
        kv_bytes = n * BLOCK_BYTES // 16
        row = {"tokens": n, "prefill_s": prefill_s, "kv_mb": kv_bytes / (1 << 20)}
        for name, g in gbps.items():
            transfer_s = kv_bytes / (g * 1e9)
            row[f"{name}_share"] = transfer_s / (prefill_s + transfer_s)
        rows.append(row)
        engine.blocks.reset_prefix_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0, 64.0, 256.0])
    ap.add_argument("--transports", nargs="+", default=["grpc", "shm", "gloo"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ttft", action="store_true", help="also the transfer share of TTFT")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.sizes_mb)
        return 0
    results = {"tcp": measure("tcp", args.sizes_mb, args.repeats)}
    for t in args.transports:
        results[t] = measure(t, args.sizes_mb, args.repeats)
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
    out: dict[str, object] = {
        "gbps": {t: {str(k): v for k, v in r.items()} for t, r in results.items()}
    }
    if args.ttft:
        big = max(args.sizes_mb)
        rows = ttft_share({t: results[t][big] for t in results})
        print("\ntransfer share of TTFT, no layer-wise streaming (prefill on this CPU)")
        for r in rows:
            shares = ", ".join(f"{t} {100 * r[f'{t}_share']:.1f}%" for t in results)
            print(
                f"{r['tokens']:5d} tokens: prefill {r['prefill_s']:.2f} s, KV {r['kv_mb']:.0f} MB; {shares}"
            )
        out["ttft"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
