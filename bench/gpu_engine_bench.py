"""GPU benchmark of the pdserve engine on random-weight Llama shapes, with floors from the same run.

Weights are random (speed does not depend on their values): no downloads, no Ray. Measures:
  1. floors: device copy bandwidth (read + write bytes / time of a 1 GiB device-to-device copy)
     and the bf16 matmul rate (8192^3), best of several each;
  2. token equality on the device: (a) triton eager vs triton + CUDA graphs, bf16, Llama-3.2-1B
     shape, 8 prompts x 32 greedy tokens (and 7 prompts: a padded graph bucket); (b) torch vs
     triton backend and (c) engine vs HF ``generate``, fp32, a small random Llama whose
     next-token distributions are peaked (initializer_range 0.1);
  3. TTFT at 512 / 2,048 tokens (Llama-3-8B shape; the 1B shape after its decode cells), vs the
     compute floor 2 x params x tokens at the measured matmul rate;
  4. decode ITL (median pure-decode step) and output tokens/s (batch / ITL) at batch
     1/16/64/256 x context 128/2,048 on the product path (triton + CUDA graphs), batch 1/64 at
     context 128 with triton eager and torch eager, and the 1B shape; vs the floor
     (weight bytes + KV bytes of every sequence at that context) / measured copy bandwidth;
  5. host time of eager decode steps: StepState.build and ModelRunner.run (host wall time until
     it returns), timed by wrapping them on the engine instance (this bench only).
Sections run in priority order under a global budget (``--budget-s``; the (256, 2,048) cell
runs last): past it, the rest is recorded as "skipped: budget". Each section and each cell
records its error and the run goes on. $OUT/gpu_bench.json is rewritten after every
measurement, so a run cut short still returns what it measured; a table is printed at the end.

On the lent device, from the repo root (the device tool sets OUT; default ./gpu-bench-out):
    python3 bench/gpu_engine_bench.py --budget-s 420
Test it on CPU first (tiny shapes, torch backend; the triton backend too under
TRITON_INTERPRET=1, set before the start):
    OMP_NUM_THREADS=1 .venv/bin/python bench/gpu_engine_bench.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from services.engine.config import EngineConfig, ModelConfig  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.loader import LoadedModel  # noqa: E402
from services.engine.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
DEFINITIONS = {
    "ttft": "median wall time of one prompt with max_tokens=1 (prefix cache reset), after a "
    "warm-up; floor = 2 x params (embedding included) x tokens / measured bf16 matmul rate",
    "decode": "itl = median wall time of a pure-decode step of the whole batch (first steps "
    "dropped); tok/s = batch / itl; floor = (engine weight bytes + KV bytes of every sequence's "
    "context) / measured copy bandwidth (read + write)",
    "host": "build = StepState.build, run = ModelRunner.run until it returns (host wall time, "
    "no sync: kernels may still run), step = itl",
}
_ids = itertools.count()

# ---- shapes, engine configurations, plans ------------------------------------------------------

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)
SMALL_PEAKED = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=4096,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


@dataclass(frozen=True)
class RunConfig:
    backend: str
    graphs: bool
    eager_twin: str  # the same backend without CUDA graphs


CONFIGS = {
    "triton+graphs": RunConfig("triton", True, "triton-eager"),
    "triton-eager": RunConfig("triton", False, "triton-eager"),
    "torch-eager": RunConfig("torch", False, "torch-eager"),
}


@dataclass(frozen=True)
class Plan:
    smoke: bool
    device: str
    shapes: dict[str, dict[str, Any]]  # "8b", "1b" (bf16 speed), "small" (fp32 equality)
    max_positions: int
    copy_bytes: int
    matmul_n: int
    ttft_lens: tuple[int, ...]
    ttft_reps: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: dict[int, int]  # context -> measured pure-decode steps
    warm_steps: int  # pure-decode steps run and dropped first (graph capture, compiles)
    compare_cells: tuple[tuple[int, int], ...]  # (batch, context) run with every config
    big_cell: tuple[int, int]  # the costliest cell: its own section, run last
    big_steps: int
    chunk: int  # max_num_batched_tokens
    eq_bf16_lens: tuple[int, ...]
    eq_bf16_tokens: int
    eq_fp32_lens: tuple[int, ...]
    eq_fp32_tokens: int

    @property
    def grid(self) -> list[tuple[int, int]]:
        cells = [(b, c) for c in self.contexts for b in self.batches]
        return [cell for cell in cells if cell != self.big_cell]

    def decode_steps(self, cell: tuple[int, int]) -> int:
        return self.big_steps if cell == self.big_cell else self.steps[cell[1]]


GPU_PLAN = Plan(
    smoke=False,
    device="cuda",
    shapes={"8b": LLAMA_8B, "1b": LLAMA_1B, "small": SMALL_PEAKED},
    max_positions=8192,
    copy_bytes=1 << 30,
    matmul_n=8192,
    ttft_lens=(512, 2048),
    ttft_reps=5,
    batches=(1, 16, 64, 256),
    contexts=(128, 2048),
    steps={128: 48, 2048: 32},
    warm_steps=2,
    compare_cells=((1, 128), (64, 128)),
    big_cell=(256, 2048),
    big_steps=16,
    chunk=16384,
    eq_bf16_lens=tuple(16 + 23 * i for i in range(8)),
    eq_bf16_tokens=32,
    eq_fp32_lens=(7, 19, 33, 50),
    eq_fp32_tokens=24,
)
SMOKE_PLAN = Plan(
    smoke=True,
    device="cpu",
    shapes={
        "8b": TINY,
        "1b": {**TINY, "tie_word_embeddings": True},
        "small": {**TINY, "initializer_range": 0.1},
    },
    max_positions=512,
    copy_bytes=1 << 24,
    matmul_n=256,
    ttft_lens=(24, 40),
    ttft_reps=2,
    batches=(1, 4),
    contexts=(16, 40),
    steps={16: 4, 40: 3},
    warm_steps=1,
    compare_cells=((1, 16), (4, 16)),
    big_cell=(8, 40),
    big_steps=3,
    chunk=64,  # the big cell's prompts take several prefill steps, as on the device
    eq_bf16_lens=tuple(5 + 3 * i for i in range(8)),
    eq_bf16_tokens=8,
    eq_fp32_lens=(3, 7, 11, 16),
    eq_fp32_tokens=8,
)


# ---- the run's record: budget, JSON after every measurement, sections ---------------------------


class BudgetExceeded(Exception):
    pass


class Skip(Exception):
    pass


class Bench:
    def __init__(self, plan: Plan, out_dir: Path, budget_s: float) -> None:
        self.plan = plan
        self.path = out_dir / "gpu_bench.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.res: dict[str, Any] = {
            "meta": {
                "smoke": plan.smoke,
                "budget_s": budget_s,
                "argv": sys.argv[1:],
                "definitions": DEFINITIONS,
            },
            "sections": {},
            "env": {},
            "floors": {},
            "equality": {},
            "ttft": [],
            "decode": [],
            "host": [],
            "engines": [],  # build time of each speed engine (CUDA graphs captured at start)
            "errors": [],
        }
        self.models: dict[str, RandomModel] = {}
        self.triton_ok = False
        self.product = "torch-eager"  # set by the env section
        self.prefill_tok_s: dict[str, float] = {}  # per shape, from TTFT: cell time estimates

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def check_deadline(self) -> None:
        if self.remaining() < 0:
            raise BudgetExceeded

    def save(self) -> None:
        self.res["meta"]["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str))
        os.replace(tmp, self.path)

    def put(self, group: str, key: str, value: Any) -> None:
        self.res[group][key] = value
        self.save()
        print(f"  {group}.{key}: {value}", flush=True)

    def add_row(self, table: str, row: dict[str, Any]) -> None:
        self.res[table].append(row)
        self.save()
        print(f"  {table}: {_short(row)}", flush=True)

    def error(self, where: str, exc: BaseException) -> str:
        self.res["errors"].append(
            {"where": where, "error": repr(exc)[:500], "traceback": traceback.format_exc()[-3000:]}
        )
        return f"error: {exc!r}"[:300]

    def section(self, name: str, fn: Callable[[Bench], None]) -> None:
        if self.remaining() <= 0:
            self.res["sections"][name] = {"status": "skipped: budget"}
            self.save()
            return
        print(f"== {name} ({self.remaining():.0f} s of budget left)", flush=True)
        t = time.monotonic()
        try:
            fn(self)
            status = "ok"
        except BudgetExceeded:
            status = "stopped: budget"
        except Skip as e:
            status = f"skipped: {e}"
        except Exception as e:
            status = self.error(name, e)
        free_memory()
        info: dict[str, Any] = {"status": status, "s": round(time.monotonic() - t, 1)}
        if torch.cuda.is_available() and self.plan.device == "cuda":
            info["peak_mem_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
            torch.cuda.reset_peak_memory_stats()
        self.res["sections"][name] = info
        self.save()
        print(f"== {name}: {status} ({info['s']} s)", flush=True)

    def cell(
        self, table: str, labels: dict[str, Any], fn: Callable[[], dict], estimate_s: float = 0
    ) -> dict | None:
        """One measurement: recorded as a row, an error row, or a skipped row (budget)."""
        if self.remaining() < estimate_s:
            self.add_row(table, {**labels, "skipped": f"budget (estimate {estimate_s:.0f} s)"})
            return None
        try:
            row = {**labels, **fn()}
        except BudgetExceeded:
            self.add_row(table, {**labels, "skipped": "budget (stopped)"})
            raise
        except Exception as e:
            self.add_row(table, {**labels, "error": self.error(str(labels), e)})
            free_memory()
            return None
        self.add_row(table, row)
        return row

    def model(self, key: str) -> RandomModel:
        if key not in self.models:
            t = time.perf_counter()
            self.models[key] = make_model(self.plan, key, torch.bfloat16)
            self.put("env", f"model_{key}", {**self.models[key].describe(), "build_s": _since(t)})
        return self.models[key]


def _short(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in row.items() if k != "runs_ms")


# ---- models, engines, prompts --------------------------------------------------------------------


@dataclass
class RandomModel:
    key: str
    mcfg: ModelConfig
    sd: dict[str, torch.Tensor]
    nparams: int
    hf: Any = None  # the HF model, kept only for equality checks

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.mcfg
        esize = next(iter(self.sd.values())).element_size()
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * esize

    def describe(self) -> dict[str, Any]:
        return {"params": self.nparams, "kv_bytes_per_token": self.kv_bytes_per_token}


def make_model(plan: Plan, key: str, dtype: torch.dtype, keep_hf: bool = False) -> RandomModel:
    """A random-weight HF Llama of the plan's shape ``key``, created on the device in ``dtype``
    (no eos: greedy runs never stop early, in HF ``generate`` as in the engine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        max_position_embeddings=plan.max_positions,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **plan.shapes[key],
    )
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(plan.device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    nparams = sum(p.numel() for p in hf.parameters())
    return RandomModel(
        key, ModelConfig.from_hf_dict(d), dict(hf.state_dict()), nparams, hf if keep_hf else None
    )


def build_engine(
    plan: Plan, model: RandomModel, config: str, dtype: str, max_seqs: int, blocks: int
) -> Engine:
    rc = CONFIGS[config]
    cfg = EngineConfig(
        device=plan.device,
        dtype=dtype,
        attention_backend=rc.backend,
        cuda_graphs=rc.graphs,
        gpu_memory_utilization=None,  # KV sized per section: several engines share the device
        num_kv_blocks=blocks,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=plan.chunk,
        block_size=BLOCK_SIZE,
        prepack_weights=False,
    )
    loaded = LoadedModel(model.mcfg, model.sd, folder=Path("."), model_id=f"rand-{model.key}")
    return Engine(loaded, None, cfg)


def blocks_for(seq_lens: Sequence[int]) -> int:
    return sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 2


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _since(t: float) -> float:
    return round(time.perf_counter() - t, 2)


def ratio(measured: float | None, floor: float | None) -> float | None:
    if measured is None or not floor:
        return None
    return round(measured / floor, 2)


# ---- env and floors ------------------------------------------------------------------------------


def section_env(bench: Bench) -> None:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": bench.plan.device,
        "git": _git_describe(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception as e:
        env["transformers"] = f"error: {e!r}"
    if bench.plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_mem_GB"] = round(props.total_memory / 1e9, 1)
        env["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    env["triton"] = _triton_status(bench)
    bench.product = "triton+graphs" if bench.triton_ok else "torch-eager"
    env["product_config"] = bench.product
    bench.res["env"].update(env)
    bench.save()
    print(f"  env: {env}", flush=True)


def _git_describe() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except Exception:
        return None


def _triton_status(bench: Bench) -> str:
    """Imports the triton backend (its kernels); on CPU it runs only under TRITON_INTERPRET=1."""
    try:
        import triton

        import services.engine.triton_backend  # noqa: F401
    except Exception as e:
        return f"error: {e!r}"[:300]
    if bench.plan.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"{triton.__version__} (not run: CPU without TRITON_INTERPRET=1)"
    bench.triton_ok = True
    return triton.__version__


def best_seconds(fn: Callable[[], object], device: str, reps: int, inner: int) -> float:
    """Best over ``reps`` of the mean time of ``inner`` back-to-back calls (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def copy_gbps(device: str, nbytes: int) -> float:
    """Read + write GB/s of a device-to-device copy of ``nbytes``."""
    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / best_seconds(lambda: y.copy_(x), device, reps=8, inner=5) / 1e9


def matmul_tflops(device: str, n: int) -> float:
    """bf16 TFLOP/s of an n x n x n matmul."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=c), device, reps=5, inner=10) / 1e12


def section_floors(bench: Bench) -> None:
    plan = bench.plan
    bench.put("floors", "copy_GBps_rw", _sig(copy_gbps(plan.device, plan.copy_bytes)))
    free_memory()
    bench.put("floors", "matmul_bf16_TFLOPs", _sig(matmul_tflops(plan.device, plan.matmul_n)))
    bench.put("floors", "matmul_n", plan.matmul_n)


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _bandwidth(bench: Bench) -> float | None:
    gbps = bench.res["floors"].get("copy_GBps_rw")
    return gbps * 1e9 if gbps else None


def _flops(bench: Bench) -> float | None:
    tf = bench.res["floors"].get("matmul_bf16_TFLOPs")
    return tf * 1e12 if tf else None


# ---- token equality ------------------------------------------------------------------------------


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if pos is None and len(a) != len(b):
        pos = min(len(a), len(b))
    return pos


def compare(got: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    diffs = [(i, first_diff(g, r)) for i, (g, r) in enumerate(zip(got, ref))]
    diffs = [(i, p) for i, p in diffs if p is not None]
    out: dict[str, Any] = {"equal": not diffs, "prompts_differing": len(diffs)}
    if diffs:
        i, p = min(diffs, key=lambda d: d[1])
        out["first_diff"] = {"prompt": i, "position": p}
    return out


def engine_greedy(
    plan: Plan,
    model: RandomModel,
    config: str,
    dtype: str,
    prompts: list[list[int]],
    new_tokens: int,
) -> tuple[list[list[int]], bool]:
    """Greedy tokens of every prompt, run together; and whether CUDA graphs were active."""
    blocks = blocks_for([len(p) + new_tokens for p in prompts])
    eng = build_engine(plan, model, config, dtype, max_seqs=8, blocks=blocks)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return eng.generate(prompts, params), eng.runner.graphs is not None


def hf_greedy(model: RandomModel, prompts: list[list[int]], new_tokens: int, device: str):
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(gen[0, len(p) :].tolist())
    return out


def equality_configs(bench: Bench) -> list[str]:
    names = ["torch-eager"]
    if bench.triton_ok:
        names.append("triton-eager")
        if bench.plan.device == "cuda":
            names.append("triton+graphs")
    return names


def section_equality_fp32(bench: Bench) -> None:
    """(b) torch vs triton backend and (c) engine vs HF generate, fp32, a peaked small Llama."""
    plan = bench.plan
    model = make_model(plan, "small", torch.float32, keep_hf=True)
    vocab, n = model.mcfg.vocab_size, plan.eq_fp32_tokens
    prompts = [prompts_of(1, length, vocab, seed=70 + length)[0] for length in plan.eq_fp32_lens]
    ref = hf_greedy(model, prompts, n, plan.device)
    got: dict[str, list[list[int]]] = {}
    for name in equality_configs(bench):
        try:
            got[name], graphs = engine_greedy(plan, model, name, "float32", prompts, n)
            bench.put(
                "equality", f"fp32_{name}_vs_hf", {**compare(got[name], ref), "graphs": graphs}
            )
        except Exception as e:
            bench.put("equality", f"fp32_{name}_vs_hf", bench.error(f"fp32 {name}", e))
    if "torch-eager" in got and "triton-eager" in got:
        bench.put(
            "equality", "fp32_torch_vs_triton", compare(got["triton-eager"], got["torch-eager"])
        )
    elif not bench.triton_ok:
        bench.put(
            "equality", "fp32_torch_vs_triton", f"not run: triton {bench.res['env']['triton']}"
        )


def section_equality_graphs(bench: Bench) -> None:
    """(a) the product config vs its eager twin, bf16, 1B shape: the same kernels, so the same
    tokens. Batch 8 fills a graph bucket exactly; batch 7 replays bucket 8 with a padded row."""
    plan = bench.plan
    graphed, eager = bench.product, CONFIGS[bench.product].eager_twin
    if plan.device == "cuda" and graphed == eager:
        raise Skip(f"no CUDA graphs without triton ({bench.res['env']['triton']})")
    model = bench.model("1b")
    vocab, n = model.mcfg.vocab_size, plan.eq_bf16_tokens
    prompts = [prompts_of(1, length, vocab, seed=90 + length)[0] for length in plan.eq_bf16_lens]
    for batch in (len(prompts), len(prompts) - 1):
        key = f"bf16_1b_{graphed}_vs_{eager}_batch{batch}"
        try:
            ref, _ = engine_greedy(plan, model, eager, "bfloat16", prompts[:batch], n)
            got, graphs = engine_greedy(plan, model, graphed, "bfloat16", prompts[:batch], n)
            bench.put("equality", key, {**compare(got, ref), "graphs": graphs})
        except Exception as e:
            bench.put("equality", key, bench.error(key, e))
        free_memory()


# ---- speed: TTFT and decode ----------------------------------------------------------------------


class HostTimers:
    """Wraps the engine's StepState.build and ModelRunner.run on the instance (this bench only)
    and sums the host wall time spent in each since the last ``take``."""

    def __init__(self, eng: Engine) -> None:
        self.totals = {"build": 0.0, "run": 0.0}
        self.calls = {"build": 0, "run": 0}
        state, runner = eng.step_state, eng.runner
        state.build = self._wrap(state.build, "build")  # type: ignore[method-assign]
        runner.run = self._wrap(runner.run, "run")  # type: ignore[method-assign]

    def _wrap(self, fn: Callable, name: str) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t
                self.calls[name] += 1

        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = dict(self.totals), dict(self.calls)
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        return out


def ttft_once(bench: Bench, eng: Engine, prompt: list[int]) -> float:
    dev = bench.plan.device
    eng.blocks.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.add_request(f"ttft-{next(_ids)}", prompt, params)
    sync(dev)
    t = time.perf_counter()
    while eng.has_unfinished:
        bench.check_deadline()
        eng.step()
    sync(dev)
    return time.perf_counter() - t


def measure_ttft(bench: Bench, eng: Engine, model: RandomModel, length: int) -> dict[str, Any]:
    prompt = prompts_of(1, length, model.mcfg.vocab_size, seed=length)[0]
    ttft_once(bench, eng, prompt)  # warm-up: kernel compiles, allocator
    runs = [ttft_once(bench, eng, prompt) for _ in range(bench.plan.ttft_reps)]
    med = statistics.median(runs)
    flops = _flops(bench)
    floor = 2 * model.nparams * length / flops if flops else None
    rate = bench.prefill_tok_s.get(model.key, 0.0)
    bench.prefill_tok_s[model.key] = max(rate, length / med)
    return {
        "ms": round(1000 * med, 2),
        "floor_ms": round(1000 * floor, 2) if floor else None,
        "ratio": ratio(med, floor),
        "runs_ms": [round(1000 * r, 2) for r in runs],
    }


def decode_max_tokens(plan: Plan, cell: tuple[int, int]) -> int:
    """Room for the measured steps plus the decodes of early requests while later ones prefill."""
    batch, ctx = cell
    # running decodes take one token each of every step's budget
    prefill_steps = -(-batch * ctx // (plan.chunk - batch)) + 2
    return plan.warm_steps + plan.decode_steps(cell) + prefill_steps + 2


def decode_steps(
    bench: Bench,
    eng: Engine,
    timers: HostTimers,
    prompts: list[list[int]],
    max_tokens: int,
    n_measure: int,
) -> list[dict[str, float]]:
    """Runs the prompts and times pure-decode steps of the whole batch, the first
    ``warm_steps`` dropped; then aborts what is left. Each sample: step seconds, the context
    tokens the step reads, and the host timers' seconds inside it."""
    dev, batch = bench.plan.device, len(prompts)
    eng.blocks.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"dec-{next(_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    samples: list[dict[str, float]] = []
    seen = 0
    try:
        while len(samples) < n_measure and eng.has_unfinished:
            bench.check_deadline()
            running = eng.scheduler.running
            pure = (
                not eng.scheduler.waiting
                and len(running) == batch
                and all(r.num_computed == r.num_tokens - 1 for r in running)
            )
            context = sum(r.num_tokens for r in running)
            sync(dev)
            timers.take()
            t = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            totals, calls = timers.take()
            if pure:
                seen += 1
                if seen > bench.plan.warm_steps:
                    samples.append(
                        {"s": dt, "context": context, **totals, "build_calls": calls["build"]}
                    )
    finally:
        _drain(eng, ids)
    if len(samples) < n_measure:
        raise RuntimeError(f"only {len(samples)} of {n_measure} pure-decode steps at batch {batch}")
    return samples


def _drain(eng: Engine, ids: list[str]) -> None:
    try:
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished:
            eng.step()
    except Exception as e:  # a broken engine: the next cell reports its own error
        print(f"  (drain failed: {e!r})", flush=True)


def measure_decode(
    bench: Bench, eng: Engine, timers: HostTimers, model: RandomModel, cell: tuple[int, int]
) -> dict[str, Any]:
    plan = bench.plan
    batch, ctx = cell
    prompts = prompts_of(batch, ctx, model.mcfg.vocab_size, seed=1000 * batch + ctx)
    n = plan.decode_steps(cell)
    samples = decode_steps(bench, eng, timers, prompts, decode_max_tokens(plan, cell), n)
    itl = statistics.median(s["s"] for s in samples)
    context = statistics.median(s["context"] for s in samples)
    weight_bytes = eng.model.weight_bytes
    kv_bytes = context * model.kv_bytes_per_token
    bw = _bandwidth(bench)
    floor = (weight_bytes + kv_bytes) / bw if bw else None
    row: dict[str, Any] = {
        "itl_ms": round(1000 * itl, 3),
        "tok_s": round(batch / itl, 1),
        "floor_ms": round(1000 * floor, 3) if floor else None,
        "ratio": ratio(itl, floor),
        "steps": len(samples),
        "weight_GB": round(weight_bytes / 1e9, 3),
        "kv_GB": round(kv_bytes / 1e9, 3),
        "run_host_ms": round(1000 * statistics.median(s["run"] for s in samples), 3),
    }
    if all(s["build_calls"] for s in samples):  # eager steps (graph replays skip build)
        row["build_ms"] = round(1000 * statistics.median(s["build"] for s in samples), 3)
    return row


def _host_row(labels: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    step = row["itl_ms"]
    return {
        **labels,
        "build_ms": row["build_ms"],
        "run_host_ms": row["run_host_ms"],
        "step_ms": step,
        "build_share": round(row["build_ms"] / step, 4),
        "run_host_share": round(row["run_host_ms"] / step, 4),
    }


def _estimate(bench: Bench, key: str, cell: tuple[int, int]) -> float:
    """Seconds a decode cell may take: its prefill at the TTFT's rate, with a margin (0 when
    no TTFT of this shape was measured yet)."""
    rate = bench.prefill_tok_s.get(key)
    return 1.5 * cell[0] * cell[1] / rate + 5 if rate else 0.0


def speed(
    bench: Bench,
    key: str,
    config: str,
    cells: Sequence[tuple[int, int]],
    ttft: str = "none",  # "first", "after" or "none"
) -> None:
    """One engine of shape ``key`` in ``config``: TTFT (before or after the decode cells) and
    the decode cells, each recorded as it is measured."""
    plan = bench.plan
    if CONFIGS[config].backend == "triton" and not bench.triton_ok:
        raise Skip(f"triton backend unavailable ({bench.res['env'].get('triton')})")
    model = bench.model(key)
    ttft_lens = plan.ttft_lens if ttft != "none" else ()
    # one cell at a time holds KV (the rest is aborted and freed): the largest one decides
    need = [blocks_for([c + decode_max_tokens(plan, (b, c))] * b) for b, c in cells]
    blocks = max([*need, *(blocks_for([n + 1]) for n in ttft_lens)])
    max_seqs = max([b for b, _ in cells] or [1])
    if cells and not ttft_lens and all(bench.remaining() < _estimate(bench, key, c) for c in cells):
        raise Skip("budget (by the estimates from TTFT)")
    t = time.perf_counter()
    eng = build_engine(plan, model, config, "bfloat16", max_seqs, blocks)
    base = {"shape": key, "config": config, "graphs": eng.runner.graphs is not None}
    bench.add_row(
        "engines",
        {**base, "max_seqs": max_seqs, "kv_blocks": blocks, "build_s": _since(t)},
    )
    timers = HostTimers(eng)

    def run_ttft() -> None:
        for length in ttft_lens:
            bench.cell(
                "ttft", {**base, "tokens": length}, partial(measure_ttft, bench, eng, model, length)
            )

    if ttft == "first":
        run_ttft()
    for cell in cells:
        labels = {**base, "batch": cell[0], "ctx": cell[1]}
        measure = partial(measure_decode, bench, eng, timers, model, cell)
        row = bench.cell("decode", labels, measure, _estimate(bench, key, cell))
        if row is not None and "build_ms" in row and cell in plan.compare_cells:
            bench.add_row("host", _host_row(labels, row))
    if ttft == "after":
        run_ttft()


# ---- the table -----------------------------------------------------------------------------------


def _fmt(v: Any, unit: str = "", nd: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def print_table(res: dict[str, Any]) -> None:
    try:
        _print_table(res)
    except Exception as e:  # the JSON has everything; never lose the run to the printing
        print(f"(table failed: {e!r})")


def _print_table(res: dict[str, Any]) -> None:
    env, fl = res["env"], res["floors"]
    print(
        f"\n=== pdserve GPU engine bench: {env.get('gpu', env.get('device'))}, torch "
        f"{env.get('torch')}, triton {env.get('triton')}, product {env.get('product_config')}, "
        f"{res['meta'].get('elapsed_s')} s ==="
    )
    print(
        f"floors: copy {fl.get('copy_GBps_rw', '-')} GB/s (read + write), "
        f"bf16 matmul {fl.get('matmul_n', '?')}^3 {fl.get('matmul_bf16_TFLOPs', '-')} TFLOP/s"
    )
    print(f"{'figure':<46} {'measured':>22} {'floor':>11} {'ratio':>7}")
    for r in res["ttft"]:
        name = f"{r['shape']} TTFT {r['tokens']} tok [{r['config']}]"
        _print_row(name, r, f"{_fmt(r.get('ms'), ' ms')}")
    for r in res["decode"]:
        name = f"{r['shape']} decode b{r['batch']} ctx{r['ctx']} [{r['config']}]"
        measured = f"{_fmt(r.get('itl_ms'), ' ms')} {_fmt(r.get('tok_s'), ' tok/s', 0)}"
        _print_row(name, r, measured)
    for r in res["engines"]:
        print(
            f"engine {r['shape']} [{r['config']}]: built in {r['build_s']} s (max_num_seqs "
            f"{r['max_seqs']}, {r['kv_blocks']} KV blocks, graphs {r['graphs']})"
        )
    for r in res["host"]:
        print(
            f"host {r['shape']} b{r['batch']} ctx{r['ctx']} [{r['config']}]: build "
            f"{r['build_ms']:.3f} ms ({100 * r['build_share']:.1f}%), run until return "
            f"{r['run_host_ms']:.2f} ms ({100 * r['run_host_share']:.0f}%) of a "
            f"{r['step_ms']:.2f} ms step"
        )
    for k, v in res["equality"].items():
        if isinstance(v, dict):
            where = v.get("first_diff")
            v = (
                "equal"
                if v["equal"]
                else f"DIFFER ({v['prompts_differing']} prompts; first {where})"
            )
        print(f"equality {k}: {v}")
    print(
        "sections: "
        + ", ".join(f"{k} {v['status']} ({v.get('s', 0)} s)" for k, v in res["sections"].items())
    )
    if res["errors"]:
        print(f"{len(res['errors'])} error(s); tracebacks in the JSON")


def _print_row(name: str, r: dict[str, Any], measured: str) -> None:
    if "skipped" in r or "error" in r:
        measured = f"skipped: {r['skipped']}" if "skipped" in r else str(r["error"])[:60]
        print(f"{name:<46} {measured}")
        return
    print(
        f"{name:<46} {measured:>22} {_fmt(r.get('floor_ms'), ' ms'):>11} "
        f"{_fmt(r.get('ratio'), 'x'):>7}"
    )


# ---- main ----------------------------------------------------------------------------------------


def sections(bench: Bench) -> list[tuple[str, Callable[[Bench], None]]]:
    """In priority order: what runs last is skipped first when the budget runs out."""
    plan = bench.plan
    return [
        ("env", section_env),
        ("floors", section_floors),
        ("equality_fp32", section_equality_fp32),
        ("equality_bf16_graphs", section_equality_graphs),
        ("8b_product", lambda b: speed(b, "8b", b.product, plan.grid, ttft="first")),
        ("8b_triton_eager", lambda b: speed(b, "8b", "triton-eager", plan.compare_cells)),
        ("8b_torch_eager", lambda b: speed(b, "8b", "torch-eager", plan.compare_cells)),
        ("1b_product", lambda b: speed(b, "1b", b.product, plan.compare_cells, ttft="after")),
        ("1b_triton_eager", lambda b: speed(b, "1b", "triton-eager", plan.compare_cells)),
        ("8b_big_cell", lambda b: speed(b, "8b", b.product, [plan.big_cell])),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (test the script)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip sections past this")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-bench-out"), help="output folder")
    ap.add_argument(
        "--only", default="", help="comma-separated section names (env and floors always run)"
    )
    args = ap.parse_args()
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    if plan.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    if plan.device == "cpu":
        torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    bench = Bench(plan, Path(args.out), args.budget_s)
    only = {s for s in args.only.split(",") if s}

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        for name, fn in sections(bench):
            if only and name not in ("env", "floors") and name not in only:
                continue
            bench.section(name, fn)
    except KeyboardInterrupt as e:
        bench.res["meta"]["interrupted"] = str(e)
        bench.save()
    finally:
        print_table(bench.res)
        print(f"results: {bench.path}")


if __name__ == "__main__":
    main()
