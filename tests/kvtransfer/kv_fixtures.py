"""Helpers shared by the KV transport tests: a dict-backed ``KVSource`` and random handles."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

import torch

from kvtransfer.base import check_layout
from kvtransfer.stream import KVStream, StreamBuffer
from services.engine import kv_quant
from services.engine.errors import UnknownRequestError
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.kv_stream import KVPiece


class DictSource:
    """A ``KVSource`` over a dict; ``delay_s`` slows every lookup (a slow sender). It takes
    any secret: the secret checks are the Outbox's (tests/kvtransfer/test_kv_secret.py)."""

    def __init__(self, handles: dict[str, KVHandle], delay_s: float = 0.0) -> None:
        self.handles = handles
        self.released: list[str] = []
        self.delay_s = delay_s
        self.streams: dict[str, KVStream] = {}  # layer-wise streams (``streaming`` transports)
        self.attached: list[bool] = []  # per receiver: did it attach before the stream finished

    def get(self, request_id: str, secret: str = "") -> KVHandle | None:
        time.sleep(self.delay_s)
        return self.handles.get(request_id)

    def release(self, request_id: str, secret: str = "") -> None:
        self.released.append(request_id)
        self.handles.pop(request_id, None)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail("released")

    def attach(self, request_id: str, want: LayoutFingerprint, secret: str = "") -> KVStream:
        stream = self.streams.get(request_id)
        if stream is None:
            raise UnknownRequestError(f"no KV stream open for request {request_id!r}")
        check_layout(stream.fingerprint, want)
        self.attached.append(stream.attach())
        return stream

    def open_stream(
        self,
        h: KVHandle,
        buffer: StreamBuffer | None = None,
        progressing: Callable[[], bool] | None = None,
    ) -> KVStream:
        """``buffer``: the stream is bounded; it refills from ``handles`` (the held KV).
        ``progressing``: the sender's engine makes progress (None: always)."""

        def held() -> KVHandle:
            if h.request_id not in self.handles:
                raise UnknownRequestError(h.request_id)
            return self.handles[h.request_id]

        stream = KVStream(h.request_id, h.fingerprint, h.num_computed, buffer, held, progressing)
        self.streams[h.request_id] = stream
        return stream


def iter_pieces(h: KVHandle, chunks: int = 2) -> Iterator[KVPiece]:
    """``h``'s KV as a chunked prefill puts it: per chunk of positions, layer by layer."""
    flat = h.blocks.flatten(2, 3)  # [layers, 2, positions, heads, dim]
    n = h.num_computed
    bounds = [n * i // chunks for i in range(chunks + 1)]
    for a, b in itertools.pairwise(bounds):
        for layer in range(h.blocks.shape[0]):
            yield KVPiece(layer, a, b, flat[layer, :, a:b].contiguous())


def feed(
    stream: KVStream, h: KVHandle, chunks: int = 2, delay_s: float = 0.0, fail_at: int = -1
) -> threading.Thread:
    """Put ``h``'s KV into ``stream`` as a chunked prefill would (per chunk of positions,
    layer by layer, ``delay_s`` per layer), then finish it (or fail it at layer ``fail_at``)."""
    n = h.num_computed

    def run() -> None:
        for step, piece in enumerate(iter_pieces(h, chunks)):
            if step == fail_at:
                stream.fail("the request was aborted")
                return
            time.sleep(delay_s)
            stream.put(piece)
        stream.finish(
            KVHandle(
                h.request_id,
                h.token_ids,
                n,
                h.fingerprint,
                h.block_hashes,
                torch.empty(0),
                h.first_logprob,
            )
        )

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def random_handle(
    layers: int = 3,
    kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    n_blocks: int = 5,
    dtype: str = "float32",
) -> KVHandle:
    fp = LayoutFingerprint("m", layers, kv_heads, head_dim, block_size, dtype)
    g = torch.Generator().manual_seed(n_blocks * 7 + layers)
    if dtype == "int8":  # quantized rows of a real cache (values, then per-32 scales)
        x = torch.randn(layers, 2, n_blocks, block_size, kv_heads, head_dim, generator=g)
        blocks = kv_quant.quantize(x)
    else:
        blocks = torch.randn(layers, 2, n_blocks, block_size, kv_heads, head_dim, generator=g)
        blocks = blocks.to(getattr(torch, dtype))
    n_tokens = n_blocks * block_size - 1
    return KVHandle(
        "r",
        tuple(range(n_tokens + 1)),
        n_tokens,
        fp,
        (b"h" * 16,) * (n_blocks - 1),
        blocks,
        -0.5,
    )
