"""The six latency questions, in order, answered from ``Evidence``: numbers, a verdict, the most
likely cause and the setting that would help. Pure: no I/O.

1. How many input tokens do requests carry, and what share of the work is prefill?
2. Is TTFT the problem, and where does it go (queue, prefill, KV transfer, first decode)?
3. Is ITL the problem: step time against batch size and the bandwidth floor, and how much
   prefill chunks slow the decode steps they ride with?
4. Does the KV cache squeeze concurrency (usage, preemptions, prefix hits, what fits)?
5. Has quantization room to help (bytes per step and the decode floor per precision)?
6. Is it batching, paging or scheduling (batch fill, chunk budget, queueing, speculation)?
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.doctor.evidence import Evidence, mean
from services.loadgen.stats import Slo, percentile

FINE, LOOK, UNKNOWN = "fine", "look here", "unknown"
_NEEDS_CLUSTER = "needs a live pdserve cluster (GET /pdserve/doctor)"
# bytes per weight of each precision pdserve serves (Q8_0: 34 bytes a block of 32; Q4_0: 18)
PRECISION_BYTES = {"bf16": 2.0, "int8": 34 / 32, "int4": 18 / 32}
# a CPU engine thread that runs for less of its steps' wall time than this is starved
CPU_SHARE_LOW = 0.75


@dataclass(frozen=True, slots=True)
class Answer:
    number: int
    question: str
    verdict: str  # fine | look here | unknown
    figures: dict[str, Any] = field(default_factory=dict)
    cause: str = ""
    action: str = ""


def diagnose(ev: Evidence, slo: Slo) -> list[Answer]:
    return [q(ev, slo) for q in (_inputs, _ttft, _itl, _kv, _quantization, _scheduling)]


def _step_s(ev: Evidence, with_prompt: bool) -> dict[int, float]:
    """The decode pool's mean step seconds by batch bucket, of steps with or without a prompt
    chunk (steps without decode rows left out)."""
    return {
        b["rows"]: b["seconds"] / b["steps"]
        for b in ev.steps("decode")
        if b["with_prompt"] == with_prompt and b["rows"]
    }


def _cpu_share(steps: list[dict[str, Any]], prof: dict[str, Any] | None) -> float:
    """The decode engine threads' CPU time over their decode steps' wall time (``steps``: the
    decode pool's buckets). NaN on a GPU (there a step waits for the device, not for a core)
    or where a replica does not report it."""
    if prof is None or not str(prof.get("device", "cpu")).startswith("cpu"):
        return math.nan
    steps = [b for b in steps if b["rows"]]
    wall = sum(b["seconds"] for b in steps)
    return sum(b["cpu_seconds"] for b in steps) / wall if wall > 0 else math.nan


def _p(xs: list[float], p: float) -> float:
    return percentile(xs, p) if xs else math.nan


def measured_costs(ev: Evidence) -> Any:
    """The cluster's own per-token costs for the simulator (``services.autoscale.modes``):
    prefill seconds per prompt token from its prompt-only steps, decode step time by batch
    from its pure decode steps; None without both (two batch sizes at least)."""
    from services.autoscale.simulator import Costs

    pools = list((ev.cluster or {}).get("pools", {}))
    only = [b for p in pools for b in ev.steps(p) if b["with_prompt"] and not b["rows"]]
    tokens = sum(b["prompt_tokens"] for b in only)
    pure = sorted(
        (b["decode_rows"] / b["steps"], b["seconds"] / b["steps"])
        for b in ev.steps("decode")
        if not b["with_prompt"] and b["rows"]
    )
    if not tokens or len(pure) < 2:
        return None
    per_token = sum(b["seconds"] for b in only) / tokens
    prefill = tuple((n, n * per_token) for n in (128.0, 512.0, 2048.0))
    return Costs(prefill_points=prefill, step_points=tuple(pure))


def mode_comparison(ev: Evidence, slo: Slo) -> dict[str, float] | None:
    """Simulated goodput per replica of each mode at this load's mix, SLOs, replica count and
    the cluster's measured costs (DistServe's comparison; ``bench/modes_bench.py`` sweeps it)."""
    from services.autoscale.modes import goodput_per_replica

    costs = measured_costs(ev)
    recs = ev.records()
    if costs is None or not recs:
        return None
    prompt = round(mean([r["prompt_tokens"] or 0 for r in recs]))
    output = max(2, round(mean([r["output_tokens"] for r in recs])))
    n = max(2, len(ev.all_replicas()))
    return {
        mode: goodput_per_replica(mode, n, costs, prompt, output, slo.ttft_s, slo.tpot_s)
        for mode in ("disaggregated", "colocated")
    }


def _quote(cmp: dict[str, float] | None) -> str:
    if cmp is None:
        return ""
    return (
        f" (simulated at this load's mix, SLOs and measured costs: disaggregated "
        f"{cmp['disaggregated']:.2f} vs colocated {cmp['colocated']:.2f} requests/s per replica)"
    )


def _inputs(ev: Evidence, slo: Slo) -> Answer:
    q = "Input lengths and the prefill share of the work"
    recs = ev.records()
    ins = [r["prompt_tokens"] for r in recs if r["prompt_tokens"] is not None]
    outs = [r["output_tokens"] for r in recs]
    fig: dict[str, Any] = {
        "prompt_tokens_p50": _p(ins, 50),
        "prompt_tokens_p90": _p(ins, 90),
        "output_tokens_p50": _p(outs, 50),
        "prefill_share_of_tokens": sum(ins) / (sum(ins) + sum(outs)) if ins else math.nan,
    }
    total = prompt_time = 0.0
    for pool in (ev.cluster or {}).get("pools", {}):
        for b in ev.steps(pool):
            total += b["seconds"]
            prompt_time += b["seconds"] if b["with_prompt"] else 0.0
    if total:
        fig["prefill_share_of_engine_time"] = prompt_time / total
    cmp = mode_comparison(ev, slo)
    if cmp is not None:
        fig["simulated_goodput_per_replica"] = cmp
    if not ins:
        return Answer(1, q, UNKNOWN, fig, "no completed request to measure")
    c = ev.cluster or {}
    if (
        c.get("mode") == "disaggregated"
        and not c.get("conditional_threshold")
        and _p(ins, 50) < 128
    ):
        return Answer(
            1, q, LOOK, fig,
            "prompts are short (p50 under 128 tokens), yet every one is prefilled on the prefill "
            "pool and its KV moved to a decode replica: the handoff costs more than computing it",
            "set conditional_threshold (e.g. 256): short prompts prefill on the decode replica",
        )  # fmt: skip
    ratio = mean(ins) / max(mean(outs), 1.0)
    if c.get("mode") == "colocated" and ratio >= 4:
        return Answer(
            1, q, FINE, fig,
            f"prompts are {ratio:.0f}x the outputs: prefill dominates the work",
            "if ITL suffers (question 3), disaggregate (mode: disaggregated) so decodes stop "
            "sharing steps with long prefills" + _quote(cmp),
        )  # fmt: skip
    return Answer(1, q, FINE, fig, f"prompt / output tokens: {ratio:.1f}x")


def _ttft(ev: Evidence, slo: Slo) -> Answer:
    q = "TTFT: queue, prefill, KV transfer and first decode"
    recs = ev.records()
    ttft = [r["ttft_s"] for r in recs if r["ttft_s"] is not None]
    fig: dict[str, Any] = {"ttft_p50_s": _p(ttft, 50), "ttft_p90_s": _p(ttft, 90),
                           "slo_ttft_s": slo.ttft_s}  # fmt: skip
    if not ttft:
        return Answer(2, q, UNKNOWN, fig, "no completed request to measure")
    timed = [r for r in recs if r.get("server")]
    parts: dict[str, list[float]] = {
        "queue": [],
        "prefill": [],
        "kv_transfer": [],
        "first_decode": [],
    }
    for r in timed:
        s = r["server"]
        qs, ps, ks = (
            s.get("queue_s") or 0.0,
            s.get("prefill_s") or 0.0,
            s.get("kv_transfer_s") or 0.0,
        )
        parts["queue"].append(qs)
        parts["prefill"].append(ps)
        parts["kv_transfer"].append(ks)
        parts["first_decode"].append(max(0.0, (s.get("ttft_s") or 0.0) - qs - ps - ks))
    for k, xs in parts.items():
        fig[f"{k}_p50_s"] = _p(xs, 50)
        fig[f"{k}_p90_s"] = _p(xs, 90)
    if fig["ttft_p90_s"] <= slo.ttft_s:
        return Answer(2, q, FINE, fig, "TTFT p90 within its SLO")
    if not timed:
        return Answer(2, q, LOOK, fig, "TTFT p90 over its SLO; the server gave no timing split",
                      "run the doctor against pdserve itself for the split")  # fmt: skip
    worst = max(parts, key=lambda k: mean(parts[k]))
    causes = {
        "queue": ("requests wait for a prefill slot: the prefill pool cannot keep up",
                  "add a prefill replica (prefill.replicas, or its autoscaling bounds)"),
        "prefill": ("computing the prompt itself takes the time",
                    "turn on prefix-aware routing if prompts share prefixes, quantize or use a "
                    "faster matmul dtype, or add prefill replicas for shorter queues behind them"),
        "kv_transfer": ("moving the KV to the decode replica takes the time",
                        "set conditional_threshold so short prompts skip the handoff, or a faster "
                        "transport (shm on one host, nccl between GPUs)"),
        "first_decode": ("the first token waits for a decode step: the decode pool is saturated",
                         "add a decode replica"),
    }  # fmt: skip
    cause, action = causes[worst]
    return Answer(2, q, LOOK, fig, f"TTFT p90 over its SLO; mostly {worst}: {cause}", action)


def _twin(pure: dict[int, float], rows: int) -> float:
    """The pure decode step to compare a mixed step of ``rows`` decode rows with: the same
    batch, else the nearest larger one (at least as slow: the ratio errs low), else the
    nearest smaller. A load seldom makes both kinds at every batch size."""
    above = [k for k in pure if k >= rows]
    return pure[min(above)] if above else pure[max(pure)]


def _itl(ev: Evidence, slo: Slo) -> Answer:
    q = "ITL against batch size, the bandwidth floor, and prefill interference"
    recs = ev.records()
    tpot = [t for r in recs if (t := r.get("tpot_s")) is not None]
    fig: dict[str, Any] = {"tpot_p50_s": _p(tpot, 50), "tpot_p90_s": _p(tpot, 90),
                           "slo_tpot_s": slo.tpot_s}  # fmt: skip
    prof = ev.profile("decode")
    steps = ev.steps("decode")
    pure, mixed = _step_s(ev, with_prompt=False), _step_s(ev, with_prompt=True)
    fig["decode_step_ms_by_batch"] = {k: v * 1e3 for k, v in sorted(pure.items())}
    fig["mixed_step_ms_by_batch"] = {k: v * 1e3 for k, v in sorted(mixed.items())}
    floor = prof["weight_bytes"] / (prof["read_gbps"] * 1e9) if prof else math.nan
    fig["bandwidth_floor_ms"] = floor * 1e3
    interference = mean([v / _twin(pure, k) for k, v in mixed.items()]) if pure else math.nan
    fig["prefill_interference"] = interference
    n_mixed = sum(b["steps"] for b in steps if b["with_prompt"] and b["rows"])
    n_decode = sum(b["steps"] for b in steps if b["rows"])
    fig["decode_steps_with_prompt_share"] = n_mixed / n_decode if n_decode else math.nan
    share = fig["decode_engine_cpu_share"] = _cpu_share(steps, prof)
    if not tpot:
        return Answer(3, q, UNKNOWN, fig, "no request with two tokens or more to measure")
    if fig["tpot_p90_s"] <= slo.tpot_s:
        return Answer(3, q, FINE, fig, "TPOT p90 within its SLO")
    if interference >= 2 and fig["decode_steps_with_prompt_share"] >= 0.1:
        return Answer(
            3, q, LOOK, fig,
            f"decode steps that carry a prompt chunk take {interference:.1f}x a pure decode step "
            f"of the same batch, and {fig['decode_steps_with_prompt_share']:.0%} of decode steps "
            "carry one: long prefills stall the decodes",
            "disaggregate (mode: disaggregated, or a conditional_threshold below the long "
            "prompts), or lower max_num_batched_tokens to cap each chunk"
            + _quote(mode_comparison(ev, slo)),
        )  # fmt: skip
    if share < CPU_SHARE_LOW:  # NOTE: before the step-time checks: a starved step looks slow
        return Answer(
            3, q, LOOK, fig,
            f"the decode engine's thread ran for {share:.0%} of its steps' wall time: the rest "
            "it waited, for a core that other threads or processes hold (the gateway, Ray, a "
            "prefill replica, anything else on the decode pool's cores) or for the GIL",
            "give the decode pool cores of its own (decode.cpus; a one-host pdserve serve "
            "splits the cores between the pools) and keep other processes off them, or add a "
            "decode replica on cores of its own",
        )  # fmt: skip
    biggest = max(pure) if pure else 0
    if pure and pure[biggest] > slo.tpot_s:
        return Answer(
            3, q, LOOK, fig,
            f"a decode step of {biggest} rows takes {pure[biggest] * 1e3:.0f} ms: the batches the "
            "load makes are too large for the ITL target",
            "add a decode replica (decode.replicas, or its autoscaling bounds)",
        )  # fmt: skip
    if 1 in pure and not math.isnan(floor) and pure[1] > 2 * floor:
        return Answer(
            3, q, LOOK, fig,
            f"a one-row step takes {pure[1] * 1e3:.1f} ms, {pure[1] / floor:.1f}x the floor of "
            "reading the weights once: the step is not bandwidth-bound",
            "check threads per replica and the precision in use (question 5)",
        )  # fmt: skip
    return Answer(3, q, LOOK, fig, "TPOT p90 over its SLO with steps near their floor",
                  "add a decode replica, or quantize (question 5)")  # fmt: skip


def _kv(ev: Evidence, slo: Slo) -> Answer:
    q = "KV pressure: usage, preemptions, prefix hits, the concurrency that fits"
    reps = ev.replicas("decode")
    fig: dict[str, Any] = {}
    if not reps:
        return Answer(4, q, UNKNOWN, fig, _NEEDS_CLUSTER)
    used, total = ev.stat("decode", "blocks_used"), ev.stat("decode", "blocks_total")
    preempted = ev.stat("decode", "num_preemptions")
    hits = sum(ev.stat(p, "prefix_hit_tokens") for p in ("prefill", "decode"))
    computed = sum(ev.stat(p, "prompt_tokens_computed") for p in ("prefill", "decode"))
    prof = reps[0]["profile"]
    recs = ev.records()
    per_request = mean([(r["prompt_tokens"] or 0) + r["output_tokens"] for r in recs])
    tokens = sum(r["profile"]["num_kv_blocks"] * r["profile"]["block_size"] for r in reps)
    fits = tokens / per_request if recs else math.nan
    fig.update(
        kv_usage=used / total if total else math.nan,
        preemptions=preempted,
        prefix_hit_rate=hits / (hits + computed) if hits + computed else math.nan,
        kv_cache_dtype=prof["kv_cache_dtype"],
        kv_tokens=tokens,
        requests_that_fit=fits,
        load_concurrency=ev.concurrency(),
    )
    squeezed = preempted > 0 or (not math.isnan(fits) and fits < fig["load_concurrency"])
    if squeezed:
        other = "int8" if prof["kv_cache_dtype"] != "int8" else None
        return Answer(
            4, q, LOOK, fig,
            f"the decode pool holds {tokens} tokens of KV, about {fits:.1f} requests at today's "
            f"lengths, for {fig['load_concurrency']:.0f} in flight; {preempted:.0f} preemptions "
            "recomputed work",
            (f"kv_cache_dtype: {other} (more tokens per byte), " if other else "")
            + "more KV memory (num_kv_blocks / gpu_memory_utilization), or another decode replica",
        )  # fmt: skip
    return Answer(4, q, FINE, fig, "the load fits the KV pool without preemption")


def _quantization(ev: Evidence, slo: Slo) -> Answer:
    q = "Quantization headroom: bytes per step and the decode floor per precision"
    prof = ev.profile("decode")
    if prof is None:
        return Answer(5, q, UNKNOWN, {}, _NEEDS_CLUSTER)
    bw = prof["read_gbps"] * 1e9
    floors = {k: prof["step_params"] * b / bw for k, b in PRECISION_BYTES.items()}
    now = prof["weight_bytes"] / bw
    pure = _step_s(ev, with_prompt=False)
    step1 = pure.get(1, math.nan)
    tpot = [t for r in ev.records() if (t := r.get("tpot_s")) is not None]
    fig = {
        "precision": prof["quantization"] if prof["quantization"] != "none" else prof["matmul_dtype"],
        "weight_bytes_per_step": prof["weight_bytes"],
        "floor_ms_now": now * 1e3,
        **{f"floor_ms_{k}": v * 1e3 for k, v in floors.items()},
        "one_row_step_ms": step1 * 1e3,
        "tpot_p50_ms": _p(tpot, 50) * 1e3,
    }  # fmt: skip
    smallest = min(floors.values())
    if not math.isnan(step1) and step1 > 1.5 * now:
        return Answer(5, q, FINE, fig,
                      f"a one-row step takes {step1 / now:.1f}x its bandwidth floor: it is not "
                      "bound by the weights' bytes, so fewer bytes would not cut ITL much")  # fmt: skip
    slow = bool(tpot) and _p(tpot, 90) > slo.tpot_s
    if now > 1.3 * smallest and slow:
        best = min(floors, key=floors.get)  # type: ignore[arg-type]
        return Answer(
            5, q, LOOK, fig,
            f"decode steps run near the floor of reading {prof['weight_bytes'] / 1e6:.0f} MB of "
            f"weights; in {best} the floor would be {floors[best] * 1e3:.1f} ms instead of "
            f"{now * 1e3:.1f} ms",
            f"quantize the weights (quantization: {best}; check its quality first)",
        )  # fmt: skip
    return Answer(5, q, FINE, fig, "no ITL problem that fewer weight bytes would solve")


def _scheduling(ev: Evidence, slo: Slo) -> Answer:
    q = "Batching, paging and scheduling"
    prof = ev.profile("decode")
    if prof is None:
        return Answer(6, q, UNKNOWN, {}, _NEEDS_CLUSTER)
    steps = ev.steps("decode")
    pure = [b for b in steps if not b["with_prompt"] and b["rows"]]
    rows = sum(b["decode_rows"] for b in pure) / max(1, sum(b["steps"] for b in pure))
    chunks = [b for p in ("prefill", "decode") for b in ev.steps(p) if b["with_prompt"]]
    chunk = sum(b["prompt_tokens"] for b in chunks) / max(1, sum(b["steps"] for b in chunks))
    drafts, accepted = (
        ev.stat("decode", "num_draft_tokens"),
        ev.stat("decode", "num_accepted_tokens"),
    )
    queue = [r["server"].get("queue_s") or 0.0 for r in ev.records() if r.get("server")]
    fig = {
        "mean_decode_batch": rows,
        "batch_fill": rows / prof["max_num_seqs"],
        "mean_prompt_chunk": chunk,
        "max_num_batched_tokens": prof["max_num_batched_tokens"],
        "waiting_now": sum(ev.stat(p, "num_waiting") for p in ("prefill", "decode")),
        "queue_p90_s": _p(queue, 90),
        "speculative_acceptance": accepted / drafts if drafts else math.nan,
    }
    if drafts and accepted / drafts < 0.3:
        return Answer(6, q, LOOK, fig,
                      f"only {accepted / drafts:.0%} of speculative drafts are accepted: verifying "
                      "them costs more than they save", "speculative_tokens: 0")  # fmt: skip
    if queue and _p(queue, 90) > 0.5 * slo.ttft_s:
        budget_bound = chunk >= 0.9 * prof["max_num_batched_tokens"]
        return Answer(
            6, q, LOOK, fig,
            "requests queue for most of their TTFT budget"
            + ("; prompt chunks fill the step budget" if budget_bound else ""),
            "raise max_num_batched_tokens (longer steps, shorter queues)" if budget_bound
            else "more replicas in the pool that queues (question 2 names it)",
        )  # fmt: skip
    return Answer(6, q, FINE, fig, "batches fill and requests do not queue long")
