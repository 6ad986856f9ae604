"""One core's arithmetic peaks, and how close a prompt's matrix products come to them.

The TTFT target of issue 18 (a 512-token prompt in at most 0.55x Hugging Face's bf16 time)
is a question about arithmetic: both engines run oneDNN's bf16 GEMM, so the ceiling is what
the core's dot-product instructions can do. This measures it from the instructions
themselves, with no library in between: a C loop of 12 independent accumulator chains
(enough to hide each instruction's latency) of
  - ``vdpbf16ps`` (AVX512-BF16: 16 lanes x a pair of bf16 products, 64 FLOP),
  - ``vpdpbusd`` (AVX512-VNNI: 16 lanes x four u8 x s8 products, 128 integer ops),
  - ``vpdpwssd`` (AVX512-VNNI: 16 lanes x a pair of int16 products, 64 ops; the decode
    kernels' instruction),
  - ``vfmadd231ps`` (fp32 FMA, 32 FLOP),
on zmm registers, built for this CPU with the host's compiler. Then oneDNN's packed bf16 GEMM
(the prompt path) on the default model's four linear shapes (SmolLM2-135M's, read from its
config) at 512 rows, as a fraction of the bf16 peak, and the 512-token prompt's floors at each
peak: the decoder's linears (2 x its linear parameters x 512 tokens) and causal attention
(4 x heads x head_dim per query-key pair, every layer).

    OMP_NUM_THREADS=1 .venv/bin/python bench/peak_rates.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import best_of

from services.engine.cpu_kernels import library


def model_shapes() -> tuple[dict[str, tuple[int, int]], int, int, int]:
    """The embedded default model's linear shapes (name: (in, out)), heads, head_dim and
    layers, from its own config."""
    from services.engine.loader import read_model_config, resolve_model

    mc = read_model_config(resolve_model(None, weights=False)[0])
    shapes = {
        "qkv": (mc.hidden_size, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim),
        "o": (mc.num_heads * mc.head_dim, mc.hidden_size),
        "gate_up": (mc.hidden_size, 2 * mc.intermediate_size),
        "down": (mc.intermediate_size, mc.hidden_size),
    }
    return shapes, mc.num_heads, mc.head_dim, mc.num_layers


# instruction, ops per zmm instruction
INSTRUCTIONS = {"vdpbf16ps": 64, "vpdpbusd": 128, "vpdpwssd": 64, "vfmadd231ps": 32}

_C = r"""
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
#define ONE(I, R) I " %%zmm30, %%zmm31, %%zmm" #R "\n"
#define TWELVE(I) ONE(I, 0) ONE(I, 1) ONE(I, 2) ONE(I, 3) ONE(I, 4) ONE(I, 5) \
    ONE(I, 6) ONE(I, 7) ONE(I, 8) ONE(I, 9) ONE(I, 10) ONE(I, 11)
/* best of 3: instructions per second of `I`, 12 independent chains */
#define RATE(I) do { \
    double best = 0; \
    for (int rep = 0; rep < 3; rep++) { \
        long n = ITERS; \
        double t = now(); \
        __asm__ volatile("1:\n" TWELVE(I) "dec %0\njnz 1b\n" : "+r"(n) :: \
            "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", \
            "zmm9", "zmm10", "zmm11", "cc"); \
        double r = 12.0 * ITERS / (now() - t); \
        if (r > best) best = r; \
    } \
    printf("%s %.6e\n", I, best); \
} while (0)
#define ITERS 20000000L
int main(void) {
#if defined(__AVX512BF16__)
    RATE("vdpbf16ps");
#endif
#if defined(__AVX512VNNI__)
    RATE("vpdpbusd");
    RATE("vpdpwssd");
#endif
#if defined(__AVX512F__)
    RATE("vfmadd231ps");
#endif
    return 0;
}
"""


def instruction_rates() -> dict[str, float]:
    """Instructions per second of each zmm instruction this CPU has (none without AVX-512)."""
    cc = library.compiler()
    if cc is None:
        raise SystemExit("no C compiler on PATH (install gcc)")
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d, "peak.c"), Path(d, "peak")
        src.write_text(_C)
        subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: float(rate) for name, rate in (line.split() for line in out.splitlines())}


def onednn_bf16(rows: int, shapes: dict[str, tuple[int, int]]) -> dict[str, float]:
    """GFLOP/s of oneDNN's packed bf16 GEMM (pdserve's prompt path) per linear shape."""
    from services.engine.packed_gemm import PackedGemm

    out = {}
    for name, (k, n) in shapes.items():
        packed = PackedGemm(torch.randn(n, k) * 0.05, torch.bfloat16)
        x = torch.randn(rows, k).bfloat16()
        packed(x, None, invariant=False)  # warm-up
        s = best_of(lambda p=packed, x=x: p(x, None, invariant=False), 10)
        out[name] = 2 * rows * k * n / s / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="the prompt's length")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    rates = instruction_rates()
    peaks = {i: rates[i] * INSTRUCTIONS[i] / 1e9 for i in rates}
    print("one core, zmm, 12 independent chains (G instructions/s, G ops/s):")
    for i, r in rates.items():
        print(f"  {i:12s} {r / 1e9:5.2f}  {peaks[i]:7.1f}")
    res: dict[str, object] = {"instructions_per_s": rates, "peak_gops": peaks}
    n = args.tokens
    shapes, heads, head_dim, layers = model_shapes()
    linear_flop = 2 * n * layers * sum(k * o for k, o in shapes.values())
    attention_flop = 4 * heads * head_dim * n * (n + 1) / 2 * layers
    res["prompt"] = {"tokens": n, "linear_gflop": linear_flop / 1e9}
    res["prompt"]["attention_gflop"] = attention_flop / 1e9  # type: ignore[index]
    print(
        f"a {n}-token prompt: linears {linear_flop / 1e9:.1f} GFLOP, causal attention "
        f"{attention_flop / 1e9:.1f} GFLOP"
    )
    for i in ("vdpbf16ps", "vpdpbusd", "vfmadd231ps"):
        if i in peaks:
            ms = (linear_flop + attention_flop) / peaks[i] / 1e6
            res["prompt"][f"floor_ms_{i}"] = ms  # type: ignore[index]
            print(f"  floor at the {i} peak: {ms:.0f} ms (linears and attention, nothing else)")
    if "vdpbf16ps" in peaks:
        gemm = onednn_bf16(n, shapes)
        res["onednn_bf16_gflops"] = gemm
        print(f"oneDNN packed bf16 GEMM at {n} rows (GFLOP/s, share of the vdpbf16ps peak):")
        for name, g in gemm.items():
            k, o = shapes[name]
            print(f"  {name:8s} {k:5d} x {o:5d}  {g:6.1f}  {g / peaks['vdpbf16ps']:5.1%}")
        linears_ms = sum(
            2 * n * layers * k * o / gemm[name] / 1e6 for name, (k, o) in shapes.items()
        )
        res["prompt"]["onednn_linears_ms"] = linears_ms  # type: ignore[index]
        print(f"  the prompt's linears at these rates: {linears_ms:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
