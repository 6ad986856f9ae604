"""SmolLM2-135M's 120 quantized linears (q4, random weights of its shapes), one core: the C
kernels (``QuantLinear`` as the engine calls it below its crossover) against oneDNN's GEMM on
the bf16 copy packed at load, by batch rows. What ``quant.KERNEL_ROWS`` is read from.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_linear_bench.py
"""

from __future__ import annotations

import time

import torch

from services.engine.cpu_kernels import library
from services.engine.quant import QuantLinear, QuantWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS = 30


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    layers = [
        (QuantLinear(QuantWeight.from_float(torch.randn(n, k, generator=gen) * 0.05, "q4"),
                     None, torch.bfloat16), k)
        for _ in range(LAYERS)
        for n, k in SHAPES
    ]  # fmt: skip
    print(f"kernels: {library.simd_level()}")
    for rows in (1, 2, 4, 8, 16, 32):
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
        best = {}
        for mode in ("kernels", "packed"):
            best[mode] = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for lin, k in layers:
                    if mode == "kernels":
                        lin._kernels(xs[k])
                    else:
                        assert lin.packed is not None
                        lin.packed(xs[k], None, invariant=False)
                best[mode] = min(best[mode], time.perf_counter() - t)
        print(
            f"rows {rows:2d}: kernels {best['kernels'] * 1e3:6.2f} ms  "
            f"oneDNN bf16 packed {best['packed'] * 1e3:6.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
