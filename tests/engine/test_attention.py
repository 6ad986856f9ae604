"""Paged attention equals dense causal attention on random inputs."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.attention import SeqSpan, TorchAttention, build_metadata
from services.engine.backend import get_backend
from services.engine.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16


def dense_attention(q, k, v, start, window=None):
    """q: [n, H, D] at positions start..start+n-1; k, v: [ctx, KV, D]."""
    rep = HEADS // KV_HEADS
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) / HEAD_DIM**0.5
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_equals_dense_ragged_mixed_batch(block_size, window):
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    num_blocks = 200
    cache = KVCache(1, num_blocks, block_size, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are scattered, not contiguous
    # (context already cached, new tokens): decodes, fresh prefills, prefills over a cached prefix
    shapes = [(0, 1), (9, 1), (33, 1), (0, 7), (0, 23), (12, 5), (17, 1), (40, 19)]
    spans, full_k, full_v = [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, KV_HEADS, HEAD_DIM)
        v = torch.randn(total, KV_HEADS, HEAD_DIM)
        if cached:
            meta0 = build_metadata([SeqSpan(0, cached, table)], block_size, "cpu")
            cache.write(0, k[:cached], v[:cached], meta0.slot_mapping)
        spans.append(SeqSpan(cached, new, table))
        full_k.append(k)
        full_v.append(v)
    meta = build_metadata(spans, block_size, "cpu", window)
    new_k = torch.cat([k[s.start :] for s, k in zip(spans, full_k)])
    new_v = torch.cat([v[s.start :] for s, v in zip(spans, full_v)])
    cache.write(0, new_k, new_v, meta.slot_mapping)
    q = torch.randn(new_k.shape[0], HEADS, HEAD_DIM)
    backend = TorchAttention()
    backend.prepare(meta)
    out = backend.forward(q, cache, 0, meta)
    offset = 0
    for s, k, v in zip(spans, full_k, full_v):
        ref = dense_attention(q[offset : offset + s.num_new], k, v, s.start, window)
        torch.testing.assert_close(out[offset : offset + s.num_new], ref, rtol=1e-5, atol=1e-5)
        offset += s.num_new


def test_pure_decode_batch_matches_dense():
    torch.manual_seed(0)
    bs = 8
    cache = KVCache(1, 64, bs, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    lens = [1, 8, 9, 30]
    spans, ks, vs, nxt = [], [], [], 0
    for n in lens:
        table = list(range(nxt, nxt + -(-n // bs)))[::-1]  # reversed tables
        nxt += len(table)
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
        cache.write(0, k, v, build_metadata([SeqSpan(0, n, table)], bs, "cpu").slot_mapping)
        spans.append(SeqSpan(n - 1, 1, table))
        ks.append(k)
        vs.append(v)
    meta = build_metadata(spans, bs, "cpu")
    q = torch.randn(len(lens), HEADS, HEAD_DIM)
    backend = TorchAttention()
    backend.prepare(meta)
    out = backend.forward(q, cache, 0, meta)
    for i, n in enumerate(lens):
        torch.testing.assert_close(
            out[i : i + 1], dense_attention(q[i : i + 1], ks[i], vs[i], n - 1), rtol=1e-5, atol=1e-5
        )


def test_backend_registry_names_valid_choices():
    with pytest.raises(ValueError, match="auto, torch, cpu, triton"):
        get_backend("flash")
    assert get_backend("auto", "cpu", torch.bfloat16).name == "torch"  # C ops are fp32
