"""Would int8 GEMMs speed up the prompt on this CPU, and does the default model's quality hold?

The prompt's linears run oneDNN's bf16 GEMM (``services.engine.packed_gemm``) at about the
core's bf16 peak; on a CPU without AMX, VNNI's int8 dot products are the one faster unit left.
This measures both halves of that trade on the embedded default (SmolLM2-135M-Instruct):

Speed: one thread, the model's four linear shapes at 512 prompt rows: oneDNN bf16 (what runs
now) against ``torch._int_mm`` (int8 x int8 -> int32, oneDNN's VNNI GEMM) alone, and with the
per-row activation quantization and the dequantizing epilogue written as torch ops. Summed over
the 30 layers. (A group-wise VNNI kernel in C for the ``A8/32`` row below, measured at 1.09x
bf16, is at commit 4c15c1d: ``git checkout 4c15c1d`` and run this script; it was not kept.)

Quality (``bench/quality_bench.py``'s text, windows and metrics against the fp32 reference):
every layer's linear at prompt size replaced by a simulation of an int8 GEMM (exact integer
products, in float64):
  now        the prompt path as it runs (oneDNN bf16 over the dequantized GGUF weights)
  W8         weights rounded to int8 with one scale per output channel, activations exact
  W8A8       the same, activations rounded to int8 with one scale per row (per token):
             what ``torch._int_mm`` can compute with one rescale per output
  W8A8 (qkv, gate/up)
             W8A8 only where the input is the normed residual (the o and down projections
             keep bf16): 65% of the prompt's linear FLOPs
  A8/32      the GGUF weights exact, activations rounded to int8 with one scale per group of
             32 inputs (as llama.cpp's Q8_0 activations): what a group-wise VNNI kernel over
             the 4-bit weights computes (prototyped at 4c15c1d, not kept)
The lm_head (the prompt computes one row of it) keeps the path it has.

    OMP_NUM_THREADS=1 .venv/bin/python bench/int8_gemm_bench.py [--windows N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quality_bench as qb

from services.engine import linear, quant
from services.engine.packed_gemm import PackedGemm

ROWS = 512
LAYERS = 30
# SmolLM2-135M: (in, out) of q|k|v, o, gate|up, down
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def _time(f, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def _shape(k: int, n: int) -> tuple[float, float, float]:
    """Seconds of (bf16, int_mm, int_mm with quant/dequant) at ``ROWS`` x ``k`` -> ``n``."""
    x, w = torch.randn(ROWS, k), torch.randn(n, k)
    xb, wb = x.bfloat16(), torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None)
    xq = torch.randint(-127, 128, (ROWS, k), dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
    sw = torch.rand(n)

    def full() -> torch.Tensor:
        s = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        q = torch.round(x / s).to(torch.int8)
        return torch._int_mm(q, wq).float().mul_(s).mul_(sw)

    bf = _time(lambda: torch.ops.mkldnn._linear_pointwise(xb, wb, None, "none", [], ""))
    return bf, _time(lambda: torch._int_mm(xq, wq)), _time(full)


def speed() -> dict[str, float]:
    """Milliseconds for one prompt's linears over all layers, per path."""
    total = {
        "bf16": 0.0,
        "int_mm": 0.0,
        "int_mm + quant/dequant (torch ops)": 0.0,
    }
    for k, n in SHAPES:
        times = _shape(k, n)
        fl = 2 * ROWS * k * n
        print(f"  {k:>5} x {n:<5} bf16 {times[0] * 1e3:6.2f} ms ({fl / times[0] / 1e9:4.0f} "
              f"GFLOP/s)   int_mm {times[1] * 1e3:6.2f} ms ({fl / times[1] / 1e9:4.0f} GOP/s)")  # fmt: skip
        for name, t in zip(total, times):
            total[name] += t * LAYERS * 1e3
    return total


class _SimulatedInt8:
    """A prompt-size linear computed as an int8 GEMM would (see the module docstring)."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, mode: str) -> None:
        self.real = PackedGemm(w.float(), dtype)
        qkv_or_gate_up = w.shape[1] == SHAPES[0][0] and w.shape[0] != SHAPES[1][1]
        self.on = w.shape[0] < 40_000 and (mode != "W8A8 (qkv, gate/up)" or qkv_or_gate_up)
        self.acts = mode != "W8"
        self.grouped = mode == "A8/32"
        wd = w.double()
        if self.grouped:  # the weights as loaded (the GGUF's 4-bit groups, exact)
            self.sw, self.wq = torch.ones(wd.shape[0], dtype=torch.float64), wd
            return
        self.sw = wd.abs().amax(1).clamp_min(1e-12) / 127
        self.wq = torch.round(wd / self.sw[:, None])

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, *, invariant: bool, keep: bool = False
    ) -> torch.Tensor:
        if not self.on:
            return self.real(x, bias, invariant=invariant, keep=keep)
        xd = x.double()
        if self.grouped:
            g = xd.view(xd.shape[0], -1, 32)
            sx = g.abs().amax(2, keepdim=True).clamp_min(1e-12) / 127
            xd = (torch.round(g / sx) * sx).view_as(xd)
        elif self.acts:
            sx = xd.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            xd = torch.round(xd / sx) * sx
        y = ((xd @ self.wq.T) * self.sw).to(x.dtype)
        return y + bias if bias is not None else y


MODES = ("now", "W8", "W8A8", "W8A8 (qkv, gate/up)", "A8/32")


def quality(n_windows: int, modes: tuple[str, ...] = MODES) -> list[qb.Row]:
    ref_eng = qb.make_engine(qb.PRECISIONS["fp32"])
    windows = qb.windows_of(ref_eng, n_windows)
    ref_row, ref = qb.run_precision("fp32", ref_eng, windows, None)
    del ref_eng
    rows = [ref_row]
    prompt_path = qb.PRECISIONS["gguf-q4 (prefill GEMMs)"]
    real = quant.packed_gemm
    for mode in modes:
        if mode != "now":
            quant.packed_gemm = linear.packed_gemm = (  # type: ignore[assignment]
                lambda w, dtype, m=mode: None if dtype is None else _SimulatedInt8(w, dtype, m)
            )
        try:
            eng = qb.make_engine(prompt_path)
            rows.append(qb.run_precision(mode, eng, windows, ref)[0])
            del eng
        finally:
            quant.packed_gemm = linear.packed_gemm = real
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4, help="windows of 256 tokens (at most)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES, help="quality rows")
    args = ap.parse_args()
    print(f"speed: {ROWS} prompt rows, one thread, the model's linears")
    sp = speed()
    for name, ms in sp.items():
        print(f"  {name:<36} {ms:7.1f} ms per prompt ({sp['bf16'] / ms:.2f}x bf16)")
    rows = quality(args.windows, tuple(args.modes))
    print(qb.table(rows))
    if args.json:
        args.json.write_text(json.dumps({"speed_ms": sp, "quality": [asdict(r) for r in rows]}))


if __name__ == "__main__":
    main()
