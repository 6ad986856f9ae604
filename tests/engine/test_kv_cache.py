"""The paged KV pool's block import (``KVCache.write_blocks``): the C copy and torch's
index_copy_ place the same bytes in the same slots, for every storage format."""

from __future__ import annotations

import pytest
import torch

from services.engine import kv_cache
from services.engine.cpu_kernels import library
from services.engine.kv_cache import KVCache

needs_kernels = pytest.mark.skipif(library.load() is None, reason="no C compiler here")


@needs_kernels
@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float32, "int8"),
        (torch.float32, "bfloat16"),
    ],
)
def test_kernel_import_places_the_same_bytes_as_torch(monkeypatch, dtype, kv_dtype):
    layers, blocks, bs, heads, hd = 3, 12, 4, 2, 64
    caches = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(kv_cache.library, "load", lambda: None)
        src = KVCache(layers, blocks, bs, heads, hd, dtype, "cpu", kv_dtype)
        g = torch.Generator().manual_seed(0)
        for layer in range(layers):
            k, v = (torch.randn(blocks * bs, heads, hd, generator=g).to(dtype) for _ in range(2))
            src.write(layer, k, v, torch.arange(blocks * bs))
        data = src.read_blocks([8, 5, 0, 9, 2])
        cache = KVCache(layers, blocks, bs, heads, hd, dtype, "cpu", kv_dtype)
        # a handle's blocks past a prefix the cache already holds (a slice along dim 2), into
        # ids out of order, next to each other, the last one
        cache.write_blocks([11, 3, 4, 7], data[:, :, 1:])
        cache.write_blocks([], data[:, :, 5:])
        caches[path] = cache
        assert torch.equal(cache.read_blocks([11, 3, 4, 7]), data[:, :, 1:])
    kernel, ref = caches["kernel"], caches["torch"]
    assert all(torch.equal(a, b) for a, b in zip(kernel.k + kernel.v, ref.k + ref.v))
    untouched = [0, 1, 2, 5, 6, 8, 9, 10, blocks]  # every other block, the scratch block too
    assert all((k[:, untouched] == 0).all() for k in kernel.k + kernel.v)
