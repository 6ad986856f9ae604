"""What batch invariance costs on CPU: the default engine (``batch_invariant: auto``, kernels by
row role: prompt rows on packed GEMMs, generated rows on the quantized kernels) against the
same engine with kernels by step size (``batch_invariant: false``), both in this run, one
thread each, on the embedded default model. Prints TTFT, ITL per batch size and output tokens/s
at 8 and 32 concurrent requests, and the ratio invariant / by-size of each.

    OMP_NUM_THREADS=1 .venv/bin/python bench/invariance_bench.py [--quantization none]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch
from engine_bench import engine_decode, engine_ttft, prompts_of

from services.engine.config import EngineConfig
from services.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="auto", help="auto (the default) or none (fp32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = dict(
        num_kv_blocks=4096,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        quantization=args.quantization,
        dtype="float32",  # NOTE: the cpu backend (batch invariance) runs fp32; auto is bf16 on AMX
    )
    engines = {
        "invariant": Engine.from_path(None, EngineConfig(**cfg)),  # type: ignore[arg-type]
        "by-size": Engine.from_path(None, EngineConfig(batch_invariant=False, **cfg)),  # type: ignore[arg-type]
    }
    assert engines["invariant"].batch_invariant and not engines["by-size"].batch_invariant
    vocab = engines["invariant"].model_config.vocab_size
    for e in engines.values():
        engine_ttft(e, prompts_of(16, 1, vocab, 0)[0])  # warm-up
    rows: dict[str, dict[str, float]] = {}

    def report(key: str, row: dict[str, float], scale: float, unit: str) -> None:
        row["ratio"] = row["invariant"] / row["by-size"]
        rows[key] = row
        print(
            f"{key:12s} invariant {row['invariant'] * scale:8.1f} {unit}   "
            f"by-size {row['by-size'] * scale:8.1f} {unit}   ratio {row['ratio']:.3f}",
            flush=True,
        )

    for n in (128, 512):
        p = prompts_of(n, 1, vocab, n)[0]
        row = {k: min(engine_ttft(e, p) for _ in range(2)) for k, e in engines.items()}
        report(f"ttft_{n}", row, 1e3, "ms")
    for b in (1, 8, 16, 32):
        ps = prompts_of(128, b, vocab, 1000 + b)
        report(f"itl_b{b}", {k: engine_decode(e, ps, 24)[0] for k, e in engines.items()}, 1e3, "ms")
    for c in (8, 32):
        ps = prompts_of(32, c, vocab, 2000 + c)
        row = {k: engine_decode(e, ps, 96)[1] for k, e in engines.items()}
        report(f"tok_s_c{c}", row, 1.0, "tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
