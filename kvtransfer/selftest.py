"""The start-up self-test of a replica's KV transport: move a payload of the replica's own
layout through a real server and client of that transport on this node, check it byte for
byte, and report the bandwidth. A transport that cannot work raises here, at start, so a
replica never serves with a transport that was asked for and silently replaced."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NoReturn

import torch

from kvtransfer.base import Transport
from services.engine.errors import UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.kv_quant import row_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SelfTest:
    transport: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class _Held:
    def __init__(self, handle: KVHandle) -> None:
        self.handle = handle
        self.released: set[str] = set()

    # NOTE: the self-test's own loopback server, stopped before the replica serves: no secret
    def get(self, request_id: str, secret: str) -> KVHandle | None:
        return None if request_id in self.released else self.handle

    def attach(self, request_id: str, want: LayoutFingerprint, secret: str) -> NoReturn:
        raise UnknownRequestError("the self-test pulls whole")

    def release(self, request_id: str, secret: str) -> None:
        self.released.add(request_id)


def self_test(
    transport: Transport, layout: LayoutFingerprint, nbytes: int = 32 << 20, timeout_s: float = 60.0
) -> SelfTest:
    """Two pulls: the first opens the connection (a process group for gloo), the second is
    timed. NCCL needs two GPUs' processes, so its bandwidth is measured on its first real
    transfers instead (the replica's KV transfer metrics), not here.

    Raises: whatever the transport raises (the replica must not start)."""
    if transport.name == "nccl":
        log.warning("KV transport nccl: available; bandwidth is measured on the first transfers")
        return SelfTest(transport.name, 0, 0.0)
    row, dtype = row_layout(layout.dtype, layout.head_dim)
    per_block = 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * row
    per_block *= torch.empty((), dtype=dtype).element_size()
    n_blocks = max(1, nbytes // per_block)
    shape = (
        layout.num_layers,
        2,
        n_blocks,
        layout.block_size,
        layout.num_kv_heads,
        row,
    )
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        blocks = torch.randn(shape, generator=gen).to(dtype)
    else:  # int8 rows: the transfer moves bytes and never reads them as values
        blocks = torch.randint(0, 256, shape, dtype=dtype, generator=gen)
    n_tokens = n_blocks * layout.block_size - 1
    handle = KVHandle("self-test", tuple(range(n_tokens + 1)), n_tokens, layout, (), blocks)
    server = transport.serve(_Held(handle), "127.0.0.1", 0)
    client = transport.client()
    try:
        client.pull(server.address, "warm-up", layout, timeout_s)
        client.release(server.address, "warm-up", timeout_s)
        t = time.perf_counter()
        got = client.pull(server.address, "self-test", layout, timeout_s)
        seconds = time.perf_counter() - t
        client.release(server.address, "self-test", timeout_s)
    finally:
        client.close()
        server.stop()
    if not torch.equal(got.blocks.cpu().view(torch.uint8), blocks.view(torch.uint8)):
        raise RuntimeError(
            f"KV transport {transport.name}: the self-test payload came back different"
        )
    result = SelfTest(transport.name, blocks.numel() * blocks.element_size(), seconds)
    log.warning(
        "KV transport %s carries KV: %.2f GB/s in its self-test (%d MiB, loopback on this node)",
        result.transport,
        result.gbps,
        result.nbytes >> 20,
    )
    return result
