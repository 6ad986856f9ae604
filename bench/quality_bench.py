"""Quality of the engine per precision on the embedded default model (SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF: Q4_1 linears, Q8_0 token embedding, tied lm_head).

Text: ``bench/data/declaration_of_independence.txt``, the United States Declaration of
Independence (1776, public domain), from "When in the Course of human events" to "...our sacred
Honor." (no title, no signatures), typed out from memory: a faithful rendering of the National
Archives transcription, not a byte-exact copy of it. It is cut into non-overlapping windows of
256 tokens (the last partial one dropped), at most ``--windows``.

Each window is one teacher-forced forward through the engine's own model, cache and attention
metadata (a request is scheduled as one span, then ``model.forward`` is asked for the logits of
every position instead of the last one; the request is aborted afterwards). A sanity check
compares the last row with the engine's normal path (``add_request`` + ``step``, greedy,
``max_tokens=1``): the same token and logprob, asserted for fp32.

Precisions (``EngineConfig`` fields; all with ``prepack_weights=False`` unless said otherwise):
  fp32          quantization="none", dtype="float32": the GGUF dequantized to fp32 (reference)
  bf16          quantization="none", dtype="bfloat16". Slow on CPUs without AVX512-BF16 / AMX
                (on AVX2 torch's bf16 GEMMs run at ~1 GFLOP/s, and the all-positions lm_head
                alone takes ~45 s per window), so it scores only the first ``--bf16-windows``
                (default 1; 0 skips it), against the same windows of fp32
  gguf-q4 (decode kernels)
                quantization="auto": the GGUF's Q4_1 linears and Q8_0 embedding / lm_head kept
                as they are, computed by pdserve's C kernels (``cpu_kernels/kernels.c`` says
                how they treat activations) in slices of 32 rows: what every decode step runs
  gguf-q4 (prefill GEMMs)
                the same with prepack_weights=True: batches over the kernels' crossover (all
                of prefill) run oneDNN fp32 GEMMs on a dequantized copy, i.e. the fp32
                reference's weights
  int8          quantization="int8": every linear and the embedding in 8-bit groups of 32
                (the Q4_1 linears requantized from their dequantized values; Q8_0 kept)
  int4          quantization="int4": 4-bit groups of 32 with a min (the Q4_1 linears kept
                as they are; the embedding / lm_head stays 8-bit since the run that measured
                4 bits there: 81.8% top-1 agreement, perplexity x1.043)
  fp32 + int8 KV, gguf-q4 + int8 KV
                kv_cache_dtype="int8": keys and values stored as int8 with a scale per 32
                values (services/engine/kv_quant.py); every position attends to the
                dequantized cache (the teacher-forced window is one prefill whose attention
                reads the cache back), so the whole effect of the KV format is in the scores
  fp32 + bf16 KV, gguf-q4 + fp32 KV
                kv_cache_dtype="bfloat16" under fp32 activations: what ``auto`` stores on a
                CPU with native bf16 (the gguf-q4 rows above use it there); and the default's
                weights over an fp32 cache, to see the KV format's part alone

Metrics, over all windows: perplexity = exp(mean NLL of the text's next tokens; a window's
last position has no in-window target and is left out), its ratio to fp32, top-1 agreement
with fp32 (share of positions whose argmax equals fp32's), mean KL(fp32 || precision) per
position, mean |logprob difference| of the actual next token vs fp32, the weight bytes one decode
step reads (``model.weight_bytes``; a prepacked copy is not counted), the forward time (with
an lm_head over all 256 positions, which a real prefill never computes: one row), and the
sanity check (token equal, |logprob difference| of the last row vs the engine's step).

    OMP_NUM_THREADS=1 .venv/bin/python bench/quality_bench.py [--windows N] [--bf16-windows N]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams

W = 256
TEXT = Path(__file__).with_name("data") / "declaration_of_independence.txt"
REF = "fp32"
PRECISIONS: dict[str, dict[str, object]] = {
    "fp32": {"quantization": "none", "dtype": "float32"},
    "bf16": {"quantization": "none", "dtype": "bfloat16"},
    "gguf-q4 (decode kernels)": {"quantization": "auto"},
    "gguf-q4 (prefill GEMMs)": {"quantization": "auto", "prepack_weights": True},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "fp32 + int8 KV": {"quantization": "none", "dtype": "float32", "kv_cache_dtype": "int8"},
    "fp32 + bf16 KV": {"quantization": "none", "dtype": "float32", "kv_cache_dtype": "bfloat16"},
    "gguf-q4 + fp32 KV": {"quantization": "auto", "kv_cache_dtype": "float32"},
    "gguf-q4 + int8 KV": {"quantization": "auto", "kv_cache_dtype": "int8"},
}
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True)
_ids = itertools.count()


@dataclass
class Row:
    precision: str
    windows: int
    perplexity: float
    ppl_ratio: float
    top1_agreement: float
    mean_kl: float
    mean_abs_dlogprob: float
    weight_mb: float = 0.0
    forward_s: float = 0.0
    sanity_token_match: bool = True
    sanity_max_dlogprob: float = 0.0


def make_engine(fields: dict[str, object]) -> Engine:
    base: dict[str, object] = {
        "prepack_weights": False,
        "num_kv_blocks": 4 * W // 16,
        "max_num_batched_tokens": W,
        "enable_prefix_caching": False,
        "threads": 1,
    }
    return Engine.from_path(None, EngineConfig(**{**base, **fields}))  # type: ignore[arg-type]


def windows_of(eng: Engine, n: int) -> list[list[int]]:
    assert eng.tokenizer is not None
    ids = eng.tokenizer.encode(TEXT.read_text())
    return [ids[a : a + W] for a in range(0, len(ids) - W + 1, W)][:n]


def drain(eng: Engine) -> None:
    while eng.has_unfinished:
        eng.step()


def all_logits(eng: Engine, ids: list[int]) -> tuple[torch.Tensor, float]:
    """Teacher-forced logits of every position [W, vocab] and the forward's seconds."""
    rid = f"quality-{next(_ids)}"
    eng.add_request(rid, ids, GREEDY)
    sched = eng.scheduler.schedule()
    assert len(sched.spans) == 1 and sched.spans[0].num_new == len(ids), "not one whole span"
    inp = eng.step_state.build(sched.spans)
    t = time.perf_counter()
    logits = eng.model.forward(
        inp.input_ids, inp.positions, eng.cache, inp.meta, eng.backend, torch.arange(len(ids))
    )
    dt = time.perf_counter() - t
    eng.abort(rid)
    drain(eng)
    return logits, dt


def engine_next(eng: Engine, ids: list[int]) -> tuple[int, float]:
    """The engine's normal path: greedy first token and its logprob."""
    rid = f"quality-{next(_ids)}"
    eng.add_request(rid, ids, GREEDY)
    outs = []
    while eng.has_unfinished:
        outs += [o for o in eng.step() if o.request_id == rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    return tokens[0], lps[0]


def sanity(eng: Engine, ids: list[int], logprobs: torch.Tensor) -> tuple[bool, float]:
    """Does the last row agree with the engine's own step? (token equal, |dlogprob|)"""
    token, lp = engine_next(eng, ids)
    last = logprobs[-1]
    return int(last.argmax()) == token, abs(float(last[token]) - lp)


def run_precision(
    name: str, eng: Engine, windows: list[list[int]], ref: list[torch.Tensor] | None
) -> tuple[Row, list[torch.Tensor]]:
    """Scores ``name`` against ``ref`` (None: it is the reference); returns its logprobs too."""
    lps: list[torch.Tensor] = []
    fwd_s, matches, worst = 0.0, True, 0.0
    for i, ids in enumerate(windows):
        logits, dt = all_logits(eng, ids)
        fwd_s += dt
        lps.append(torch.log_softmax(logits.float(), dim=-1))
        if ref is None or i == 0:  # every window for the reference, the first for the others
            same, dlp = sanity(eng, ids, lps[-1])
            assert same or ref is not None, f"{name}: window {i}: last-row argmax != engine's token"
            matches, worst = matches and same, max(worst, dlp)
    row = score(name, windows, lps, (ref or lps)[: len(windows)])
    row.weight_mb, row.forward_s = eng.model.weight_bytes / 1e6, fwd_s
    row.sanity_token_match, row.sanity_max_dlogprob = matches, worst
    return row, lps


def score(
    name: str,
    windows: list[list[int]],
    lps: list[torch.Tensor],
    ref: list[torch.Tensor],
) -> Row:
    nll, ref_nll, dlp, agree, kl = [], [], [], [], []
    for ids, lp, rp in zip(windows, lps, ref):
        tgt = torch.tensor(ids[1:])[:, None]
        tok_lp, ref_lp = lp[:-1].gather(1, tgt)[:, 0], rp[:-1].gather(1, tgt)[:, 0]
        nll.append(-tok_lp)
        ref_nll.append(-ref_lp)
        dlp.append((tok_lp - ref_lp).abs())
        agree.append((lp.argmax(-1) == rp.argmax(-1)).float())
        kl.append((rp.exp() * (rp - lp)).sum(-1).clamp_min(0))
    ppl = math.exp(float(torch.cat(nll).mean()))
    ref_ppl = math.exp(float(torch.cat(ref_nll).mean()))
    return Row(
        precision=name,
        windows=len(windows),
        perplexity=ppl,
        ppl_ratio=ppl / ref_ppl,
        top1_agreement=float(torch.cat(agree).mean()),
        mean_kl=float(torch.cat(kl).mean()),
        mean_abs_dlogprob=float(torch.cat(dlp).mean()),
    )


def table(rows: list[Row]) -> str:
    head = (
        "| precision | windows | perplexity | / fp32 | top-1 agree | mean KL "
        "| mean abs dlogprob | weights MB | forward s | vs engine step |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.precision} | {r.windows} | {r.perplexity:.3f} | {r.ppl_ratio:.4f} "
            f"| {100 * r.top1_agreement:.2f}% | {r.mean_kl:.2e} | {r.mean_abs_dlogprob:.2e} "
            f"| {r.weight_mb:.1f} | {r.forward_s:.2f} "
            f"| {'ok' if r.sanity_token_match else 'TOKEN DIFFERS'} {r.sanity_max_dlogprob:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=6, help="windows of 256 tokens (at most)")
    ap.add_argument("--bf16-windows", type=int, default=1, help="bf16 windows (0: skip)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    names = [n for n in PRECISIONS if n != "bf16" or args.bf16_windows > 0]
    t0 = time.perf_counter()
    windows: list[list[int]] = []
    ref: list[torch.Tensor] | None = None
    rows: list[Row] = []
    for name in names:  # the reference first
        eng = make_engine(PRECISIONS[name])
        windows = windows or windows_of(eng, args.windows)
        n = min(args.bf16_windows, len(windows)) if name == "bf16" else len(windows)
        row, lps = run_precision(name, eng, windows[:n], ref)
        ref = ref or lps
        rows.append(row)
        del eng
        print(f"  {name}: ppl {row.perplexity:.3f}, {row.forward_s:.1f}s", flush=True)
    print(table(rows))
    print(f"\nwindows of {W} tokens; total {time.perf_counter() - t0:.0f}s")
    if args.json:
        out = {"window_tokens": W, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
