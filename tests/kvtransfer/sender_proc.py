"""A KV sender in its own process, for the killed-sender contract test: serves one random
handle ("r") with the named transport, slowly (so it can be killed mid-transfer), and prints
its address. Run: python -m tests.kvtransfer.sender_proc <transport> <n_blocks> [stream]
(stream: a layer-wise stream of "r", fed one piece per 0.2 s, as a slow prefill would)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvtransfer.transport import get_transport
from tests.kvtransfer.kv_fixtures import DictSource, feed, random_handle


def start(transport: str, n_blocks: int, *mode: str) -> tuple[subprocess.Popen[str], str]:
    """Run this module in a child process; returns it and the address it serves at."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.kvtransfer.sender_proc", transport, str(n_blocks), *mode],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    address = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if not address:
        proc.kill()
        raise RuntimeError("the sender did not start")
    return proc, address


def main() -> None:
    name, n_blocks = sys.argv[1], int(sys.argv[2])
    h = random_handle(layers=30, kv_heads=3, head_dim=64, block_size=16, n_blocks=n_blocks)

    def slow_message(msg):  # type: ignore[no-untyped-def]
        # shm sends one message (the segment's name): hold it past the kill
        time.sleep(5.0 if msg.header.shm_name else 0.2)
        return msg

    def slow_chunk(seq: int, chunk: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return chunk

    hook = (
        {"chunk_hook": slow_chunk} if name in ("gloo", "nccl") else {"message_hook": slow_message}
    )
    if sys.argv[3:] == ["stream"]:
        src = DictSource({})
        server = get_transport(name).serve(src, "127.0.0.1", 0)
        feed(src.open_stream(h), h, chunks=4, delay_s=0.2)
    else:
        opts = {"chunk_bytes": 1 << 20, **hook}
        server = get_transport(name).serve(DictSource({"r": h}), "127.0.0.1", 0, **opts)
    print(server.address, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
