"""Exercises the NCCL KV transport for real: a prefill-side and a decode-side process, each on
its own GPU, move KV payloads of the default model's layout through ``DistTransport("nccl")``
(pairwise group over the TCPStore rendezvous, GPU tensors end to end, sum64 checksums) and
report GB/s and byte equality. Needs 2 GPUs (NCCL refuses two ranks on one device).

    .venv/bin/python bench/nccl_check.py [--sizes-mb 16 64 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp


def _sender(sizes: list[float], q: mp.Queue, done: mp.Event) -> None:  # type: ignore[type-arg]
    torch.cuda.set_device(0)
    import dataclasses

    from bench.kv_transfer_bench import Source, handle
    from kvtransfer.transport import get_transport

    handles = {}
    for mb in sizes:
        h = handle(mb)
        handles[f"{mb}"] = dataclasses.replace(h, blocks=h.blocks.cuda())
    server = get_transport("nccl").serve(Source(handles), "127.0.0.1", 0)
    q.put(server.address)
    done.wait()
    server.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64, 256])
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"nccl_check: needs 2 GPUs, this machine has {torch.cuda.device_count()}; not run")
        return 2
    from bench.kv_transfer_bench import LAYOUT, handle
    from kvtransfer.transport import get_transport

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_sender, args=(args.sizes_mb, q, done))
    p.start()
    try:
        address = q.get(timeout=120)
        torch.cuda.set_device(1)
        client = get_transport("nccl").client()
        for mb in args.sizes_mb:
            want = handle(mb).blocks
            client.pull(address, f"{mb}", LAYOUT, 120)  # warm-up (opens the pair)
            torch.cuda.synchronize()
            t = time.perf_counter()
            got = client.pull(address, f"{mb}", LAYOUT, 120)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            same = torch.equal(got.blocks.cpu(), want)
            print(f"{mb:6g} MB: {want.numel() * 4 / dt / 1e9:7.2f} GB/s, byte-exact: {same}")
        client.close()
    finally:
        done.set()
        p.join(timeout=60)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
