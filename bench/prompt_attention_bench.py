"""Prompt attention on one CPU core: pdserve's prompt kernel against torch's SDPA.

The shape is SmolLM2-135M's (9 query heads, 3 KV heads, 64 dims); one sequence per call, its
keys and values in a paged cache of 16-token blocks in shuffled order, fp32 and bf16 (the
default on CPUs with native bf16; with AVX512-BF16 the kernel's products are bf16 dot products
there) (the kernel reads
them through the block table; SDPA gets them gathered, as the torch reference backend does,
and the gather is timed with it). Cases: whole prompts (causal) of 128-2,048 tokens, and a
256-token chunk after a 1,792-token cached prefix. Prints ms per layer, GFLOP/s (causal
FLOPs: 4 * heads * dim per (query, attended key) pair) and the kernel's speed-up, and the
largest difference from a float64 reference (for the bf16 cache: over its rounded values).

    OMP_NUM_THREADS=1 .venv/bin/python bench/prompt_attention_bench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.cpu_kernels import library
from services.engine.kv_quant import FORMAT_CODES

H, KVH, D, BS = 9, 3, 64, 16
CASES = ((128, 128), (256, 256), (512, 512), (1024, 1024), (2048, 2048), (2048, 256))


def _time(f, reps: int) -> float:  # type: ignore[no-untyped-def]
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def case(lib, ctx: int, n: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    blocks = -(-ctx // BS)
    table = torch.randperm(blocks).int()
    kc, vc = torch.randn(KVH, blocks * BS, D), torch.randn(KVH, blocks * BS, D)
    kh, vh = kc.bfloat16(), vc.bfloat16()
    q = torch.randn(n, H, D)
    out = torch.empty_like(q)
    scratch = torch.empty(lib.pdserve_prompt_attention_scratch(ctx, H, KVH, D))
    slots = (table.long()[:, None] * BS + torch.arange(BS)).flatten()[:ctx]
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    mask = torch.arange(ctx)[None, :] <= q_pos
    causal = n == ctx

    def kernel(k: torch.Tensor = kc, v: torch.Tensor = vc) -> None:
        lib.pdserve_prompt_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), blocks * BS, table.data_ptr(), ctx, n,
            H, KVH, D, BS, 0, D**-0.5, out.data_ptr(), scratch.data_ptr(),
            FORMAT_CODES[str(k.dtype).removeprefix("torch.")],
        )  # fmt: skip

    def sdpa(dtype: torch.dtype) -> torch.Tensor:
        k, v = kc[:, slots].to(dtype), vc[:, slots].to(dtype)
        qs = q.transpose(0, 1)[None].to(dtype)
        return F.scaled_dot_product_attention(
            qs, k[None], v[None], attn_mask=None if causal else mask, is_causal=causal,
            enable_gqa=True,
        )  # fmt: skip

    reps = max(3, int(2e8 / (n * ctx * H * D)))
    t_kernel = _time(kernel, reps)
    t_fp32 = _time(lambda: sdpa(torch.float32), reps)
    t_bf16 = _time(lambda: sdpa(torch.bfloat16), reps)

    def reference(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].double(), k[:, slots][None].double(),
            v[:, slots][None].double(), attn_mask=mask, enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip

    t_kernel_bf16 = _time(lambda: kernel(kh, vh), reps)
    want_bf16 = reference(kh, vh)
    err_bf16 = float((out.double() - want_bf16).abs().max())
    err_sdpa_bf16 = float(
        (sdpa(torch.bfloat16)[0].transpose(0, 1).double() - want_bf16).abs().max()
    )
    kernel()
    want = reference(kc, vc)
    pairs = sum(min(ctx, ctx - n + i + 1) for i in range(n))
    flops = 4 * H * D * pairs
    return {
        "ctx": ctx,
        "n": n,
        "kernel_ms": t_kernel * 1e3,
        "sdpa_fp32_ms": t_fp32 * 1e3,
        "sdpa_bf16_ms": t_bf16 * 1e3,
        "kernel_gflops": flops / t_kernel / 1e9,
        "kernel_bf16_cache_ms": t_kernel_bf16 * 1e3,
        "kernel_bf16_cache_gflops": flops / t_kernel_bf16 / 1e9,
        "kernel_bf16_cache_max_err": err_bf16,
        "sdpa_bf16_max_err": err_sdpa_bf16,
        "sdpa_fp32_gflops": flops / t_fp32 / 1e9,
        "speedup_vs_fp32": t_fp32 / t_kernel,
        "kernel_max_err": float((out.double() - want).abs().max()),
        "sdpa_fp32_max_err": float((sdpa(torch.float32)[0].transpose(0, 1) - want).abs().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = library.load()
    if lib is None:
        raise SystemExit(library.load_error())
    print(f"simd: {library.simd_level()}; ms per layer, one sequence")
    print("   ctx      n |  kernel  GFLOP/s | bf16 cache  GFLOP/s | SDPA fp32  GFLOP/s "
          "| SDPA bf16 | kernel vs fp32 | max err kernel / bf16 cache / SDPA / SDPA bf16")  # fmt: skip
    rows = []
    for ctx, n in CASES:
        r = case(lib, ctx, n)
        rows.append(r)
        print(f"{ctx:6d} {n:6d} | {r['kernel_ms']:7.2f} {r['kernel_gflops']:7.0f}  "
              f"| {r['kernel_bf16_cache_ms']:10.2f} {r['kernel_bf16_cache_gflops']:8.0f} "
              f"| {r['sdpa_fp32_ms']:8.2f} {r['sdpa_fp32_gflops']:8.0f}  | {r['sdpa_bf16_ms']:8.2f}  "
              f"| {r['speedup_vs_fp32']:13.2f}x | {r['kernel_max_err']:.1e} / "
              f"{r['kernel_bf16_cache_max_err']:.1e} / {r['sdpa_fp32_max_err']:.1e} / "
              f"{r['sdpa_bf16_max_err']:.1e}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
