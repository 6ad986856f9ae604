"""Engine benchmark on the embedded default model (SmolLM2-135M-Instruct), one thread.

Measures, in one run and on the same fp32 weights:
  - TTFT for 128/512/2048-token prompts: pdserve engine vs HF transformers (forward + 1 token)
  - ITL at batch 1/8/32: pdserve vs HF ``generate`` (decode time / decode tokens)
  - output tokens/s at 32 concurrent requests vs batch 1
  - the decode floor: weight bytes read per step / measured memory bandwidth (single-thread
    matrix-vector product over a weight-sized matrix), and measured ITL / floor
Prints ratios, which stay meaningful on a noisy machine where absolute times drift.

    OMP_NUM_THREADS=1 .venv/bin/python bench/engine_bench.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams


def prompts_of(n_tokens: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n_tokens)] for _ in range(count)]


def measure_bandwidth(nbytes: int) -> float:
    """GB/s of a single-thread fp32 matrix-vector product over ``nbytes`` of matrix."""
    cols = 2048
    w = torch.randn(nbytes // 4 // cols, cols)
    x = torch.randn(1, cols)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return w.numel() * 4 / best / 1e9


def engine_ttft(eng: Engine, prompt: list[int]) -> float:
    eng.blocks.reset_prefix_cache()
    eng.add_request(
        f"ttft-{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0)
    )
    t = time.perf_counter()
    while eng.has_unfinished:
        eng.step()
    return time.perf_counter() - t


def engine_decode(eng: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Returns (mean ITL over pure-decode steps, output tokens/s over the whole run)."""
    eng.blocks.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"d{i}-{time.perf_counter_ns()}", p, params)
    step_times: list[float] = []
    n_out = 0
    start = time.perf_counter()
    while eng.has_unfinished:
        decoding = (
            all(r.num_computed >= r.num_prompt for r in eng.scheduler.running)
            and not eng.scheduler.waiting
        )
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        n_out += sum(len(o.new_token_ids) for o in outs)
        if decoding and outs:
            step_times.append(dt)
    total = time.perf_counter() - start
    return statistics.mean(step_times), n_out / total


def hf_times(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Returns (TTFT = generate 1 token, ITL = extra time per decode step)."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    t1 = run(1)
    tn = run(new_tokens + 1)
    return t1, (tn - t1) / new_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="shorter prompts and fewer tokens (smoke run)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ttft_lens = [32, 64] if args.quick else [128, 512, 2048]
    batches = [1, 4] if args.quick else [1, 8, 32]
    new_tokens = 8 if args.quick else 32
    ctx = 128

    eng = Engine.from_path(
        None, EngineConfig(num_kv_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=64)
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(_cache_folder()), dtype=torch.float32).eval()
    vocab = eng.model_config.vocab_size
    results: dict[str, object] = {"model": eng.model_id, "threads": torch.get_num_threads()}

    engine_ttft(eng, prompts_of(16, 1, vocab, 0)[0])  # warm-up
    rows = []
    for n in ttft_lens:
        p = prompts_of(n, 1, vocab, n)
        ours = min(engine_ttft(eng, p[0]) for _ in range(2))
        ref, _ = hf_times(hf, p, 1)
        rows.append(
            {"prompt_tokens": n, "pdserve_s": ours, "hf_s": ref, "hf_over_pdserve": ref / ours}
        )
        print(
            f"TTFT {n:5d} tokens: pdserve {ours * 1000:8.1f} ms   HF {ref * 1000:8.1f} ms   HF/pdserve {ref / ours:5.2f}x",
            flush=True,
        )
    results["ttft"] = rows

    bw = measure_bandwidth(eng.model.weight_bytes)
    floor = eng.model.weight_bytes / (bw * 1e9)
    results["bandwidth_gbs"] = bw
    results["weight_bytes"] = eng.model.weight_bytes
    results["decode_floor_s"] = floor
    print(
        f"decode floor: {eng.model.weight_bytes / 1e6:.0f} MB of weights / {bw:.1f} GB/s = {floor * 1000:.1f} ms",
        flush=True,
    )

    rows = []
    for b in batches:
        ps = prompts_of(ctx, b, vocab, 1000 + b)
        itl, _ = engine_decode(eng, ps, new_tokens)
        _, ref_itl = hf_times(hf, ps, new_tokens)
        rows.append(
            {
                "batch": b,
                "pdserve_itl_s": itl,
                "hf_itl_s": ref_itl,
                "hf_over_pdserve": ref_itl / itl,
                "itl_over_floor": itl / floor,
            }
        )
        print(
            f"ITL batch {b:3d} (context {ctx}): pdserve {itl * 1000:7.1f} ms   HF {ref_itl * 1000:7.1f} ms   "
            f"HF/pdserve {ref_itl / itl:5.2f}x   pdserve/floor {itl / floor:4.2f}x",
            flush=True,
        )
    results["itl"] = rows

    # Throughput: output tokens/s over whole requests (prefill included), concurrent vs alone.
    top = batches[-1]
    tp_prompt, tp_out = (16, 16) if args.quick else (32, 96)
    tps = {}
    for b in (1, top):
        _, tps[b] = engine_decode(eng, prompts_of(tp_prompt, b, vocab, 2000 + b), tp_out)
        print(
            f"throughput {b:3d} concurrent ({tp_prompt}-token prompts, {tp_out} output tokens): {tps[b]:7.1f} tok/s",
            flush=True,
        )
    results["throughput_tokens_per_s"] = tps
    results["throughput_ratio"] = tps[top] / tps[1]
    print(f"output tokens/s at {top} concurrent / alone: {tps[top] / tps[1]:.1f}x", flush=True)
    eng.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _cache_folder():
    from services.engine.loader import default_model_path, gguf_cache_folder

    return gguf_cache_folder(default_model_path())


if __name__ == "__main__":
    main()
