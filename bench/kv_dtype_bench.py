"""KV cache dtype: what bf16 and int8 KV buy on the embedded default model, one thread.

Measures, for an fp32 cache, a bf16 cache (what ``kv_cache_dtype: auto`` stores on a CPU with
native bf16) and int8 (a scale per 32 values, ``services/engine/kv_quant.py``), in one run:
  - capacity: bytes per token and per block, blocks and 2,048-token requests that fit in
    ``--budget-mib`` of KV memory;
  - concurrency under that budget: ``--requests`` requests of ``--prompt-tokens`` random
    prompt tokens and ``--output-tokens`` output tokens (a decode-heavy load) all submitted at
    once to an engine whose pool is the budget (``max_num_seqs`` 64): output tokens/s,
    preemptions (a request evicted and recomputed because the pool ran out), peak running
    batch;
  - long-context decode: the median pure-decode step at batch 1 and 4 with ``--context``
    tokens each, where attention reads the whole cache every step (on an engine with room
    for all of them, so both formats run the same batch).
Quality per KV dtype (perplexity, top-1 agreement): bench/quality_bench.py.

    OMP_NUM_THREADS=1 .venv/bin/python bench/kv_dtype_bench.py [--json out.json]
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

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import engine_decode, prompts_of

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.kv_cache import KVCache
from services.engine.sampling_params import SamplingParams

KV = ("float32", "bfloat16", "int8")


def capacity(eng: Engine, budget: int, kv: str) -> dict[str, float]:
    mc = eng.model_config
    per_block = KVCache.bytes_per_block(
        mc.num_layers, eng.config.block_size, mc.num_kv_heads, mc.head_dim, kv
    )
    blocks = budget // per_block
    return {
        "bytes_per_token": per_block / eng.config.block_size,
        "blocks": blocks,
        "requests_of_2048": blocks * eng.config.block_size // 2048,
    }


def under_budget(eng: Engine, prompts: list[list[int]], n: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    pre = eng.stats().num_preemptions
    for i, p in enumerate(prompts):
        eng.add_request(f"c{i}", p, params)
    peak, out = 0, 0
    t = time.perf_counter()
    while eng.has_unfinished:
        outs = eng.step()
        out += sum(len(o.new_token_ids) for o in outs)
        peak = max(peak, len(eng.scheduler.running))
    dt = time.perf_counter() - t
    return {
        "tokens_per_s": out / dt,
        "seconds": dt,
        "preemptions": eng.stats().num_preemptions - pre,
        "peak_running": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    budget = args.budget_mib << 20
    res: dict[str, dict[str, object]] = {}
    for kv in KV:
        probe = Engine.from_path(None, EngineConfig(num_kv_blocks=16, kv_cache_dtype=kv))
        cap = capacity(probe, budget, probe.kv_dtype)
        name = probe.kv_dtype
        del probe
        eng = Engine.from_path(
            None,
            EngineConfig(
                num_kv_blocks=int(cap["blocks"]),
                kv_cache_dtype=kv,
                max_num_seqs=64,
                max_num_batched_tokens=1024,
            ),
        )
        vocab = eng.model_config.vocab_size
        row: dict[str, object] = {"capacity": cap}
        ps = prompts_of(args.prompt_tokens, args.requests, vocab, 11)
        row["under_budget"] = under_budget(eng, ps, args.output_tokens)
        eng.check_integrity()
        del eng
        roomy = Engine.from_path(
            None, EngineConfig(num_kv_blocks=4 * (args.context + 64) // 16 + 8, kv_cache_dtype=kv)
        )
        for b in (1, 4):
            ps = prompts_of(args.context, b, vocab, 20 + b)
            row[f"decode_step_b{b}_ctx{args.context}_ms"] = engine_decode(roomy, ps, 16)[0] * 1e3
        roomy.check_integrity()
        del roomy
        res[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    f = res["float32"]
    for name in ("bfloat16", "int8"):
        q = res[name]
        print(
            f"{name} vs fp32 KV: {q['capacity']['blocks'] / f['capacity']['blocks']:.2f}x blocks "  # type: ignore[index]
            f"in {args.budget_mib} MiB; tok/s under that budget "
            f"{q['under_budget']['tokens_per_s'] / f['under_budget']['tokens_per_s']:.2f}x"  # type: ignore[index]
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
