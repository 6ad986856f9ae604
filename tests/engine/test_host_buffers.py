"""The host buffer pool reuses a buffer only after nothing uses its memory, and stays
within its bounds."""

from __future__ import annotations

import gc

import torch

from services.engine.host_buffers import HOST_BUFFERS, HostBufferPool
from services.engine.kv_cache import empty_bytes

MB = 1 << 20


def test_a_buffer_returns_only_when_its_last_view_dies():
    pool = HostBufferPool(max_free_bytes=64 * MB)
    a = pool.take(3 * MB)
    addr = a.data_ptr()
    kv = a.view(torch.float32).reshape(3, -1)[1:]  # what a handle keeps: a view of a view
    del a
    gc.collect()
    b = pool.take(3 * MB)
    assert b.data_ptr() != addr  # still in use through ``kv``
    del kv
    gc.collect()
    assert pool.stats().free_bytes == 4 * MB  # whole huge pages
    c = pool.take(3 * MB + 5)
    assert c.data_ptr() == addr and c.numel() == 3 * MB + 5
    s = pool.stats()
    assert (s.hits, s.misses, s.free_bytes, s.in_use_bytes) == (1, 2, 0, 8 * MB)
    del b, c


def test_numpy_arrays_over_the_tensor_keep_the_buffer_too():
    pool = HostBufferPool()
    t = pool.take(2 * MB)
    arr = t.numpy()
    del t
    gc.collect()
    assert pool.stats().free_bytes == 0
    arr[:] = 7  # the memory is still this array's alone
    other = pool.take(2 * MB)
    assert other.data_ptr() != arr.ctypes.data
    del arr
    gc.collect()
    assert pool.stats().free_bytes == 2 * MB


def test_fit_and_bounds():
    pool = HostBufferPool(max_free_bytes=10 * MB, min_bytes=MB)
    big, mid = pool.take(8 * MB), pool.take(4 * MB)
    del big, mid
    gc.collect()
    assert pool.stats().free_bytes == 12 * MB - 8 * MB  # over the bound: the oldest went
    assert pool.take(2 * MB).data_ptr() != 0 and pool.stats().hits == 1  # 4 MB fits 2 MB
    assert pool.take(MB // 2).numel() == MB // 2 and pool.stats().misses == 2  # small: fresh
    assert pool.take(0).numel() == 0


def test_engine_buffers_come_from_the_pool_on_the_host():
    before = HOST_BUFFERS.stats().in_use_bytes
    t = empty_bytes(3 * MB)
    assert t.dtype == torch.uint8 and t.shape == (3 * MB,) and t.device.type == "cpu"
    assert HOST_BUFFERS.stats().in_use_bytes == before + 4 * MB  # whole huge pages
    del t
    gc.collect()
    assert HOST_BUFFERS.stats().in_use_bytes == before


def test_configure_bounds_what_is_kept_at_once_and_zero_keeps_nothing():
    pool = HostBufferPool(max_free_bytes=64 * MB)
    bufs = [pool.take(2 * MB) for _ in range(3)]
    del bufs
    gc.collect()
    assert pool.stats().free_bytes == 6 * MB
    pool.configure(4 * MB)
    assert pool.stats().free_bytes == 4 * MB
    pool.configure(0)
    t = pool.take(2 * MB)
    del t
    gc.collect()
    assert pool.stats().free_bytes == 0
