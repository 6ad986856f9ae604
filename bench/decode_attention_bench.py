"""Decode attention on one CPU core, per KV cache format: pdserve's decode kernel over a paged
cache of fp32, bf16 and int8 rows, against the bandwidth floor of each format.

The shape is SmolLM2-135M's (30 layers, 9 query heads, 3 KV heads, 64 dims); a batch of B
sequences of one context length each, one query token per sequence (a pure decode step), their
16-token blocks in shuffled order, as a cache that has served a while holds them (a sequence's
blocks lie anywhere). Prints ms per step (every layer's attention; nothing else of the step),
the context bytes a step reads, the floor (those bytes at the measured single-thread read
bandwidth) and the kernel's distance from it, and the largest difference from the torch
reference over the same cache (which widens the same stored rows).

    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_attention_bench.py [--batch 8]
        [--contexts 128 380 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.attention import SeqSpan, TorchAttention, build_metadata
from services.engine.bandwidth import read_gbps
from services.engine.cpu_backend import CpuAttention
from services.engine.kv_cache import KVCache

LAYERS, H, KVH, D, BS = 30, 9, 3, 64, 16
FORMATS = ("float32", "bfloat16", "int8")


def step_case(kv: str, batch: int, ctx: int) -> dict[str, float]:
    n_blocks = batch * -(-ctx // BS) + 4
    cache = KVCache(LAYERS, n_blocks, BS, KVH, D, torch.float32, "cpu", kv)
    every = torch.arange(n_blocks * BS)
    g = torch.Generator().manual_seed(ctx)
    for layer in range(LAYERS):
        k, v = (torch.randn(len(every), KVH, D, generator=g) for _ in range(2))
        cache.write(layer, k, v, every)
    free = list(range(n_blocks))
    random.Random(ctx).shuffle(free)
    spans = [SeqSpan(ctx - 1, 1, [free.pop() for _ in range(-(-ctx // BS))]) for _ in range(batch)]
    meta = build_metadata(spans, BS, "cpu", None)
    att = CpuAttention()
    att.prepare(meta)
    q = torch.randn(batch, H, D, generator=g)
    ref = TorchAttention()
    ref_meta = build_metadata(spans, BS, "cpu", None)
    ref.prepare(ref_meta)
    err = float((att.forward(q, cache, 0, meta) - ref.forward(q, cache, 0, ref_meta)).abs().max())

    def step() -> None:
        for layer in range(LAYERS):
            att.forward(q, cache, layer, meta)

    step()
    best = float("inf")
    for _ in range(15):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    row_bytes = cache.k[0].shape[-1] * cache.k[0].element_size()
    read = 2 * LAYERS * KVH * batch * ctx * row_bytes  # keys and values of every position
    return {"ms": best * 1e3, "mb_read": read / 1e6, "max_abs_err": err, "read_bytes": read}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 380, 1024])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gbps = read_gbps()
    print(f"read bandwidth {gbps:.1f} GB/s; batch {args.batch}, {LAYERS} layers", flush=True)
    print("| context | KV format | ms / step | MB read | floor ms | / floor | vs fp32 | max err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for ctx in args.contexts:
        rows = {kv: step_case(kv, args.batch, ctx) for kv in FORMATS}
        for kv, r in rows.items():
            r["floor_ms"] = r["read_bytes"] / (gbps * 1e9) * 1e3
            print(
                f"| {ctx} | {kv} | {r['ms']:.2f} | {r['mb_read']:.1f} | {r['floor_ms']:.2f} "
                f"| {r['ms'] / r['floor_ms']:.2f}x | {rows['float32']['ms'] / r['ms']:.2f}x "
                f"| {r['max_abs_err']:.1e} |",
                flush=True,
            )
        out[str(ctx)] = rows
    if args.json:
        Path(args.json).write_text(
            json.dumps({"gbps": gbps, "batch": args.batch, "rows": out}, indent=2)
        )


if __name__ == "__main__":
    main()
