"""The ``cpu`` backend's C ops against the torch reference ops on random inputs (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.attention import SeqSpan, TorchAttention, build_metadata
from services.engine.config import ModelConfig
from services.engine.cpu_kernels import library
from services.engine.kv_cache import KVCache
from services.engine.layer_ops import TorchOps
from services.engine.rope import Rotary

pytestmark = pytest.mark.skipif(library.load() is None, reason=str(library.load_error()))


@pytest.fixture(scope="module")
def cpu():
    from services.engine.cpu_backend import CpuAttention, CpuOps

    return CpuAttention(), CpuOps()


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(cpu, with_residual):
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(5, 67, generator=g), torch.randn(5, 67, generator=g), torch.randn(67)
    res = r if with_residual else None
    got = cpu[1].add_rms_norm(x, res, w, 1e-5)
    want = TorchOps().add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the sum: same rounding
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_dtype,dim", [("float32", 16), ("int8", 64)])
def test_rope_and_cache(cpu, kv_dtype, dim):
    """Same bytes in the cache: for int8 the C quantizer rounds exactly as kv_quant does."""
    cfg = ModelConfig("llama", 100, 6 * dim, 64, 1, 6, 2, dim, 128)
    rot = Rotary(cfg, 128, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, (6 + 4) * dim, generator=g)  # a fused projection: strided views
    qkv[0, 6 * dim + 2 * dim : 6 * dim + 2 * dim + 32] = 0  # an all-zero int8 group
    positions = torch.tensor([0, 5, 77, 127])
    slots = torch.tensor([3, -1, 40, 9])  # -1: padding, not written
    outs = []
    for ops in (TorchOps(), cpu[1]):
        cache = KVCache(1, 8, 8, 2, dim, torch.float32, "cpu", kv_dtype)
        q, k, v = qkv.clone().split((6 * dim, 2 * dim, 2 * dim), dim=-1)
        q, k, v = q.view(4, 6, dim), k.view(4, 2, dim), v.view(4, 2, dim)
        keep = slots >= 0  # the torch reference has no padding rule: give it the real rows
        if isinstance(ops, TorchOps):
            qo, ko = ops.rope_and_cache(
                q, k, v, ops.rope_tables(positions, rot), cache, 0, slots.clamp(min=0)
            )
            kc, vc = cache.flat(0)
            kc[:, 0] = 0  # undo the padding row's write to slot 0
            vc[:, 0] = 0
        else:
            qo, ko = ops.rope_and_cache(q, k, v, ops.rope_tables(positions, rot), cache, 0, slots)
        outs.append((qo.clone(), ko.clone(), cache.k[0].clone(), cache.v[0].clone()))
        assert keep.sum() == 3
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_silu_and_mul(cpu):
    gu = torch.randn(3, 2 * 50, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        cpu[1].silu_and_mul(gu), TorchOps().silu_and_mul(gu), rtol=1e-6, atol=1e-6
    )


def test_silu_and_mul_on_bf16_rounds_the_fp32_result_once(cpu):
    """The bf16 rows of the MLP on AMX hosts: exactly the fp32 kernel's result on the widened
    inputs, rounded to nearest even (vector lanes and the scalar tail alike: 50 = 3 x 16 + 2);
    extreme gates and a NaN too."""
    gu = (torch.randn(3, 2 * 50, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    gu[0, :3] = torch.tensor([-200.0, 200.0, float("nan")]).bfloat16()
    got = cpu[1].silu_and_mul(gu)
    want = cpu[1].silu_and_mul(gu.float()).bfloat16()  # torch rounds to nearest even
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[~want.isnan()], want[~want.isnan()]) and got[0, 2].isnan()


@pytest.mark.parametrize("kv_dtype,dim", [("float32", 16), ("int8", 64)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_attention_matches_reference(cpu, window, block_size, kv_dtype, dim):
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    cache = KVCache(1, 120, block_size, 2, dim, torch.float32, "cpu", kv_dtype)
    every = torch.arange(120 * block_size)
    cache.write(0, torch.randn(len(every), 2, dim), torch.randn(len(every), 2, dim), every)
    free = list(range(120))
    rng.shuffle(free)
    spans = []
    for n in (1, 5, 17, 33):
        table = [free.pop() for _ in range(-(-n // block_size))]
        spans.append(SeqSpan(n - 1, 1, table))
    q = torch.randn(len(spans), 6, dim)
    outs = []
    for att in (TorchAttention(), cpu[0]):
        meta = build_metadata(spans, block_size, "cpu", window)
        att.prepare(meta)
        outs.append(att.forward(q, cache, 0, meta))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
