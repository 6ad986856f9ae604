"""Exercises the NCCL KV transport for real: a prefill-side and a decode-side process, each on
its own GPU, move KV payloads of the default model's layout through ``DistTransport("nccl")``
(pairwise group over the TCPStore rendezvous, GPU tensors end to end, sum64 checksums) and
report GB/s and byte equality; then one layer-wise stream (pieces put on the sender's GPU
layer by layer while the receiver reads them). Needs 2 GPUs (NCCL refuses two ranks on one
device).

    .venv/bin/python bench/nccl_check.py [--sizes-mb 16 64 256] [--backend gloo]

``--backend gloo`` runs the same script on CPU (a dry run of its logic, not of NCCL).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp


def _sender(backend: str, sizes: list[float], q: mp.Queue, done: mp.Event) -> None:  # type: ignore[type-arg]
    gpu = backend == "nccl"
    if gpu:
        torch.cuda.set_device(0)
    from bench.kv_transfer_bench import Source, handle
    from kvtransfer.transport import get_transport

    handles = {}
    for mb in sizes:
        h = handle(mb)
        handles[f"{mb}"] = dataclasses.replace(h, blocks=h.blocks.cuda() if gpu else h.blocks)
    source = Source(handles)
    server = get_transport(backend).serve(source, "127.0.0.1", 0)
    q.put(server.address)
    _feed_stream(source, handles[f"{sizes[0]}"])
    done.wait()
    server.stop()


def _feed_stream(source, h) -> None:  # type: ignore[no-untyped-def]
    """Stream ``h`` as request "s", layer by layer in two chunks of positions, as a prefill's
    per-layer hook would."""
    from kvtransfer.stream import KVStream
    from services.engine.kv_stream import KVPiece

    stream = source.streams["s"] = KVStream("s", h.fingerprint, h.num_computed)
    flat = h.blocks.flatten(2, 3)  # [layers, 2, positions, heads, dim]
    n = h.num_computed
    for a, b in ((0, n // 2), (n // 2, n)):
        for layer in range(flat.shape[0]):
            time.sleep(0.01)
            stream.put(KVPiece(layer, a, b, flat[layer, :, a:b].contiguous()))
    stream.finish(dataclasses.replace(h, blocks=torch.empty(0)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64, 256])
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    args = ap.parse_args()
    gpu = args.backend == "nccl"
    if gpu and torch.cuda.device_count() < 2:
        print(f"nccl_check: needs 2 GPUs, this machine has {torch.cuda.device_count()}; not run")
        return 2
    from bench.kv_transfer_bench import LAYOUT, handle
    from kvtransfer.transport import get_transport

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_sender, args=(args.backend, args.sizes_mb, q, done))
    p.start()
    try:
        address = q.get(timeout=120)
        if gpu:
            torch.cuda.set_device(1)
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        client = get_transport(args.backend).client()
        for mb in args.sizes_mb:
            want = handle(mb).blocks
            client.pull(address, f"{mb}", LAYOUT, 120)  # warm-up (opens the pair)
            sync()
            t = time.perf_counter()
            got = client.pull(address, f"{mb}", LAYOUT, 120)
            sync()
            dt = time.perf_counter() - t
            same = torch.equal(got.blocks.cpu(), want)
            print(f"{mb:6g} MB: {want.numel() * 4 / dt / 1e9:7.2f} GB/s, byte-exact: {same}")
        want = handle(args.sizes_mb[0]).blocks.flatten(2, 3)
        got, _ = client.pull_stream(address, "s", LAYOUT, 120)
        n = want.shape[2] - 1  # the handle's num_computed: the last slot is not KV
        same = torch.equal(got.blocks.flatten(2, 3)[:, :, :n].cpu(), want[:, :, :n])
        print(
            f"layer-wise stream of {args.sizes_mb[0]:g} MB over {args.backend}: byte-exact: {same}"
        )
        client.release(address, "s", 10)
        client.close()
    finally:
        done.set()
        p.join(timeout=60)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
