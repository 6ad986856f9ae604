"""Engine benchmark on the embedded default model (SmolLM2-135M-Instruct), one thread each.

Measures in one run, beside the anchors (every engine on the same weights, one thread):
  - pdserve's default (``quantization: auto``: the GGUF's Q4_1 linears and Q8_0 embedding
    computed by pdserve's kernels; batch-invariant), the same with kernels chosen by step size
    (``batch_invariant: false``), and pdserve fp32 (``quantization: none``, the GGUF
    dequantized), against HF transformers fp32 and bf16 and llama.cpp (llama-cpp-python on the
    same GGUF file, when installed);
  - TTFT at 128 / 512 / 2,048-token prompts; the compute floor 2 x params x tokens (the
    decoder's parameters for every token, the lm_head's for the one row sampled) at the
    measured single-thread fp32 GEMM rate;
  - ITL at batch 1 / 8 / 32 (128-token contexts); the bandwidth floor of each precision:
    bytes of weights one step reads / measured single-thread memory bandwidth;
  - output tokens/s at 8 and 32 concurrent requests (whole requests, prefill included);
  - the non-GEMM share of a batch-1 step (time outside the linear layers / step time);
  - prompt-lookup speculative decoding on a copy-heavy workload (copy a given text): tokens
    equal to plain decoding, acceptance rate, output tokens/s with and without it.
Prints ratios, which stay meaningful on a noisy machine where absolute times drift.

    OMP_NUM_THREADS=1 .venv/bin/python bench/engine_bench.py [--quick] [--json out.json]
        [--baseline-tree /tmp/old]   (a git worktree of the commit to compare tokens/s with)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.loader import default_model_path, gguf_cache_folder
from services.engine.sampling_params import SamplingParams

TEXT = Path(__file__).with_name("data") / "declaration_of_independence.txt"


def prompts_of(n_tokens: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n_tokens)] for _ in range(count)]


def best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def floors() -> dict[str, float]:
    """Single-thread memory bandwidth (GB/s, a matrix-vector product over 256 MB: reads the
    matrix once) and GEMM rates (GFLOP/s, 512 x 576 x 1536, SmolLM2's MLP shape): fp32, and
    bf16 on oneDNN's packed weights where the CPU has native bf16 (AMX), pdserve's prompt path."""
    # NOTE: imported here: the baseline tree's run (--tokens-only) has neither module
    from services.engine.packed_gemm import PackedGemm
    from services.engine.precision import cpu_has_native_bf16

    w = torch.randn(16384, 4096)
    x = torch.randn(1, 4096)
    bw = w.numel() * 4 / best_of(lambda: torch.nn.functional.linear(x, w)) / 1e9
    a, b = torch.randn(512, 576), torch.randn(576, 1536)
    flop = 2 * 512 * 576 * 1536
    out = {"bandwidth_gbs": bw, "gemm_gflops": flop / best_of(lambda: a @ b, 10) / 1e9}
    if cpu_has_native_bf16():
        packed = PackedGemm(b.t().contiguous(), torch.bfloat16)
        ab = a.bfloat16()
        out["gemm_gflops_bf16"] = (
            flop / best_of(lambda: packed(ab, None, invariant=False), 10) / 1e9
        )
    return out


# ---- pdserve ------------------------------------------------------------------------------
def engine_ttft(eng: Engine, prompt: list[int]) -> float:
    eng.blocks.reset_prefix_cache()
    eng.add_request(
        f"t-{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0)
    )
    t = time.perf_counter()
    while eng.has_unfinished:
        eng.step()
    return time.perf_counter() - t


def engine_decode(eng: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(median pure-decode step, output tokens/s over the whole run, prefill included)."""
    eng.blocks.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"d{i}-{time.perf_counter_ns()}", p, params)
    steps: list[float] = []
    n_out = 0
    start = time.perf_counter()
    while eng.has_unfinished:
        running = eng.scheduler.running
        decoding = (
            all(r.num_computed >= r.num_prompt for r in running) and not eng.scheduler.waiting
        )
        t = time.perf_counter()
        outs = eng.step()
        if decoding and outs:
            steps.append(time.perf_counter() - t)
        n_out += sum(len(o.new_token_ids) for o in outs)
    return statistics.median(steps), n_out / (time.perf_counter() - start)


def gemm_share(eng: Engine, prompt: list[int], steps: int = 40) -> dict[str, float]:
    """Where a batch-1 decode step's time goes. GEMM: every linear of the step (each layer's
    four and the lm_head) timed alone on one row, best of 20 calls, summed, over the median
    pure-decode step at this context; timed alone a linear runs with warm caches, so the
    non-GEMM share (1 - gemm_share) is an upper bound. Where the step runs fused (one C call
    for every layer, ``services/engine/cpu_decode.py``), that call is timed in the step too,
    with the lm_head's call, which splits the rest: in-kernel non-GEMM (attention, norms,
    RoPE, SwiGLU: the fused call minus its linears timed alone, an upper bound) and host
    overhead (metadata, embedding, sampling, Python: the step minus the fused call and the
    lm_head's call, both timed in the step)."""
    model = eng.model
    lins = [getattr(lw, n) for lw in model.layers for n in ("qkv", "o", "gate_up", "down")]

    def alone(lin: object) -> float:
        k = lin.in_features if hasattr(lin, "in_features") else lin.w_t.shape[0]  # type: ignore[attr-defined]
        x = torch.randn(1, k)
        return best_of(lambda: lin(x), 20)  # type: ignore[operator]

    layers_s = sum(alone(lin) for lin in lins)
    head_s = alone(model.lm_head)
    fused = eng.runner.fused
    calls: list[float] = []
    heads: list[float] = []

    def timer(f: Callable[..., torch.Tensor], into: list[float]) -> Callable[..., torch.Tensor]:
        def timed(*a: object) -> torch.Tensor:
            t = time.perf_counter()
            out = f(*a)
            into.append(time.perf_counter() - t)
            return out

        return timed

    saved_head = model.lm_head
    if fused is not None:
        fused.run = timer(fused.run, calls)  # type: ignore[method-assign]
        model.lm_head = timer(saved_head, heads)  # type: ignore[assignment,arg-type]
    try:
        eng.blocks.reset_prefix_cache()
        step, _ = engine_decode(eng, [prompt], steps)
    finally:
        model.lm_head = saved_head
        if fused is not None:
            del fused.run  # back to the class's method
    out = {
        "step_ms": step * 1e3,
        "gemm_ms": (layers_s + head_s) * 1e3,
        "gemm_share": (layers_s + head_s) / step,
    }
    if calls:
        c, h = statistics.median(calls), statistics.median(heads)
        out["fused_call_ms"] = c * 1e3
        out["lm_head_in_step_ms"] = h * 1e3
        out["in_kernel_non_gemm_ms"] = (c - layers_s) * 1e3
        out["host_overhead_ms"] = (step - c - h) * 1e3
        out["non_gemm_share"] = (step - c - h + c - layers_s) / step
    return out


def copy_workload(path: str | None, k: int) -> dict[str, object]:
    """Greedy copy of a given text with and without prompt-lookup speculation."""
    outs, rates = {}, {}
    text = TEXT.read_text()[:1200]
    for spec in (0, k):
        eng = Engine.from_path(path, EngineConfig(num_kv_blocks=512, speculative_tokens=spec))
        tok = eng.tokenizer
        chat = [{"role": "user", "content": "Copy this text exactly:\n\n" + text}]
        ids = tok.encode(tok.apply_chat_template(chat))
        params = SamplingParams(max_tokens=128, temperature=0)
        eng.generate([ids], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        t = time.perf_counter()
        (out,) = eng.generate([ids], params)
        rates[spec] = len(out) / (time.perf_counter() - t)
        outs[spec] = out
        st = eng.stats()
    return {
        "tokens_equal": outs[0] == outs[k],
        "acceptance": st.num_accepted_tokens / max(1, st.num_draft_tokens),
        "tokens_per_s_plain": rates[0],
        "tokens_per_s_speculative": rates[k],
        "speedup": rates[k] / rates[0],
    }


# ---- anchors ------------------------------------------------------------------------------
class HFAnchor:
    def __init__(self, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        folder = gguf_cache_folder(default_model_path())  # the dequantized GGUF: same weights
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()

    def generate(self, prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts)
        t = time.perf_counter()
        with torch.no_grad():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    def ttft(self, prompt: list[int]) -> float:
        return self.generate([prompt], 1)

    def itl(self, prompts: list[list[int]], n: int) -> float:
        return (self.generate(prompts, n + 1) - self.generate(prompts, 1)) / n


class LlamaCppAnchor:
    """llama-cpp-python on the same GGUF file (Q4_1), one thread."""

    def __init__(self) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(default_model_path()),
            n_ctx=4096,
            n_threads=1,
            n_threads_batch=1,
            n_batch=2048,
            verbose=False,
            logits_all=False,
        )

    def _run(self, prompt: list[int], n: int) -> float:
        self.llm.reset()
        t = time.perf_counter()
        it = self.llm.generate(prompt, temp=0.0, top_k=1, reset=True)
        for i, _ in enumerate(it):
            if i + 1 >= n:
                break
        return time.perf_counter() - t

    def ttft(self, prompt: list[int]) -> float:
        return self._run(prompt, 1)

    def itl(self, prompts: list[list[int]], n: int) -> float:
        return (self._run(prompts[0], n + 1) - self._run(prompts[0], 1)) / n


def make_anchors() -> dict[str, object]:
    anchors: dict[str, object] = {
        "hf-fp32": HFAnchor(torch.float32),
        "hf-bf16": HFAnchor(torch.bfloat16),
    }
    try:
        anchors["llama.cpp-q4_1"] = LlamaCppAnchor()
    except ImportError as e:
        print(f"llama.cpp anchor skipped: {e} (pip install llama-cpp-python)", flush=True)
    return anchors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter prompts and fewer tokens")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--baseline-tree",
        default=None,
        help="also measure tokens/s at 8 and 32 concurrent with this source tree's default "
        "engine (e.g. a git worktree of an earlier commit), in this run",
    )
    ap.add_argument("--tokens-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.tokens_only:  # the baseline tree's run: only APIs every earlier tree has
        eng = Engine.from_path(
            None, EngineConfig(num_kv_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=64)
        )
        vocab = eng.model_config.vocab_size
        out = {
            f"c{c}": engine_decode(eng, prompts_of(32, c, vocab, 2000 + c), 96)[1] for c in (8, 32)
        }
        print("BASELINE " + json.dumps(out))
        return
    ttft_lens = [64, 128] if args.quick else [128, 512, 2048]
    batches = [1, 8] if args.quick else [1, 8, 32]
    new_tokens = 8 if args.quick else 32
    res: dict[str, object] = {"floors": floors()}
    fl = res["floors"]
    print(
        f"floors: {fl['bandwidth_gbs']:.1f} GB/s, {fl['gemm_gflops']:.1f} GFLOP/s fp32, "
        f"{fl.get('gemm_gflops_bf16', 0):.1f} GFLOP/s bf16 (0: no native bf16)",
        flush=True,
    )
    cfg = dict(num_kv_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=64)
    engines = {
        "pdserve-default": Engine.from_path(None, EngineConfig(**cfg)),
        # kernels by step size, not by row role: faster above 16 rows, not batch-invariant
        "pdserve-by-size": Engine.from_path(None, EngineConfig(batch_invariant=False, **cfg)),
        # the reference: fp32 throughout over the dequantized GGUF
        "pdserve-fp32": Engine.from_path(
            None, EngineConfig(quantization="none", dtype="float32", **cfg)
        ),
    }
    anchors = make_anchors()
    vocab = engines["pdserve-fp32"].model_config.vocab_size
    # NOTE: a prompt token meets the decoder's weights; the embedding is a row gather, and
    # the lm_head (tied to it here) runs for the last row only
    hf = anchors["hf-fp32"].model  # type: ignore[attr-defined]
    body = sum(
        p.numel()
        for n, p in hf.named_parameters()
        if "embed_tokens" not in n and "lm_head" not in n
    )
    head = vocab * hf.config.hidden_size
    for e in engines.values():
        engine_ttft(e, prompts_of(16, 1, vocab, 0)[0])  # warm-up
    rows: dict[str, dict[str, float]] = {}
    for n in ttft_lens:
        p = prompts_of(n, 1, vocab, n)[0]
        row = {name: min(engine_ttft(e, p) for _ in range(2)) for name, e in engines.items()}
        row.update({name: a.ttft(p) for name, a in anchors.items()})  # type: ignore[attr-defined]
        flop = 2 * (body * n + head)
        row["floor"] = flop / (fl["gemm_gflops"] * 1e9)
        if "gemm_gflops_bf16" in fl:  # the default's prompt GEMMs run in bf16 here
            row["floor-bf16"] = flop / (fl["gemm_gflops_bf16"] * 1e9)
        rows[f"ttft_{n}"] = row
        print(
            f"TTFT {n:5d}: " + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in row.items()),
            flush=True,
        )
    for b in batches:
        ps = prompts_of(128, b, vocab, 1000 + b)
        row = {name: engine_decode(e, ps, new_tokens)[0] for name, e in engines.items()}
        for name, a in anchors.items():
            if b == 1 or not name.startswith("llama.cpp"):  # llama-cpp-python decodes one stream
                row[name] = a.itl(ps, new_tokens)  # type: ignore[attr-defined]
        for name, e in engines.items():
            row[f"floor-{name}"] = e.model.weight_bytes / (fl["bandwidth_gbs"] * 1e9)
        rows[f"itl_b{b}"] = row
        print(
            f"ITL b{b:3d}: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row.items()),
            flush=True,
        )
    for c in (8, 32):
        ps = prompts_of(32, c, vocab, 2000 + c)
        rows[f"tokens_per_s_c{c}"] = {
            name: engine_decode(e, ps, 96 if not args.quick else 16)[1]
            for name, e in engines.items()
        }
        print(f"tok/s at {c} concurrent: {rows[f'tokens_per_s_c{c}']}", flush=True)
    if args.baseline_tree and not args.quick:
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline_tree).resolve())}
        run = subprocess.run(
            [sys.executable, __file__, "--tokens-only"],
            env=env, cwd=args.baseline_tree, capture_output=True, text=True, check=True,
        )  # fmt: skip
        line = next(x for x in run.stdout.splitlines() if x.startswith("BASELINE "))
        base = json.loads(line.removeprefix("BASELINE "))
        for c in (8, 32):
            rows[f"tokens_per_s_c{c}"]["baseline-tree"] = base[f"c{c}"]
        print(f"baseline tree {args.baseline_tree}: tok/s {base}", flush=True)
    p = prompts_of(128, 1, vocab, 7)[0]
    rows["gemm_share_b1"] = {name: gemm_share(e, p) for name, e in engines.items()}  # type: ignore[misc]
    print(f"GEMM share of a batch-1 step: {rows['gemm_share_b1']}", flush=True)
    res["rows"] = rows
    res["speculative_copy"] = copy_workload(None, 4)
    print(f"prompt-lookup speculation (copy a text, greedy): {res['speculative_copy']}", flush=True)
    for e in engines.values():
        e.check_integrity()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
