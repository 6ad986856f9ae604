"""The ``cpu`` backend: the per-layer ops and decode attention as pdserve's C kernels.

A batch-1 decode step of a small model is hundreds of tiny torch ops (about 55 a layer), and
on CPU each costs a few microseconds of dispatch: for SmolLM2 that was about a third of the
step. Here each op is one C call (``cpu_kernels/kernels.c``), the same arithmetic in the same
order as the torch reference (``layer_ops.TorchOps``; -ffp-contract=off), in fp32 over a
cache of fp32, bf16 or int8 rows (widened to fp32 as they are read). Spans longer than
SHORT_SPAN (prompts) attend through the prompt kernel (``pdserve_prompt_attention``,
flash-style, AVX-512), else through the torch reference (SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention import AttentionMetadata, TorchAttention
from services.engine.cpu_kernels import library
from services.engine.kv_cache import KVCache
from services.engine.rope import Rotary

MAX_HEAD_DIM = 512  # the rope kernel's stack buffer


def _lib():
    lib = library.load()
    if lib is None:
        raise RuntimeError(library.load_error())
    return lib


SHORT_SPAN = 8  # spans up to this long attend token by token through the decode kernel


def token_rows(
    meta: AttentionMetadata, seqs: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token of the step (of the sequences ``seqs``; None: all) as a decode row: (its
    sequence's block-table row, its own context length = position + 1), [num_tokens, width]
    and [num_tokens] int32. The step's keys and values are all written before attention, so
    for a span of several tokens this is exactly causal attention, computed as its tokens
    would be computed one step at a time."""
    if seqs is None:
        if meta.is_pure_decode:
            return meta.block_tables, meta.seq_lens
        seqs = list(range(meta.num_seqs))
    ns = [meta.query_lens[i] for i in seqs]
    lens = torch.tensor(
        [meta.context_lens[i] - n + j + 1 for i, n in zip(seqs, ns) for j in range(n)],
        dtype=torch.int32,
    )
    seq = torch.repeat_interleave(
        torch.tensor(seqs, dtype=torch.long), torch.tensor(ns, dtype=torch.long)
    )
    return meta.block_tables[seq].contiguous(), lens


@dataclass(slots=True)
class _SpanPlan:
    """A step with a prompt span, for the prompt kernel: short spans' tokens as decode rows
    (``rows``: their flat token rows, None when there are none), long spans by sequence."""

    rows: torch.Tensor | None
    tables: torch.Tensor  # [len(rows), width] int32
    lens: torch.Tensor  # [len(rows)] int32
    spans: list[tuple[int, int, torch.Tensor, int]]  # q_start, q_end, block-table row, ctx


def prompt_kernel_fits() -> bool:
    """The prompt kernel is the fast path here: an AVX-512 CPU (elsewhere its portable C is
    slower than SDPA's kernel)."""
    return "avx512f" in library.cpu_flags().split()


class CpuAttention:
    """Decode kernel for steps made of short spans (decodes, speculative verifications);
    for steps with a longer span or a prompt span the prompt kernel (AVX-512, ``prompt_dtype``
    None) or else the torch reference (SDPA). Measured on one Zen 4 core (SmolLM2: 9 heads, 3
    KV heads, 64 dims; ``bench/prompt_attention_bench.py``): 1.9x SDPA's fp32 causal kernel
    at 256-512 tokens over an fp32 cache; over a bf16 cache (the default there) with
    AVX512-BF16 its products are bf16 dot products and its softmax runs a tile of rows at a
    time, another 1.8-2.2x at 256-2,048 tokens. With ``prompt_dtype`` bf16 (AMX hosts) SDPA's
    bf16 kernel stays."""

    def __init__(self, prompt_dtype: torch.dtype | None = None) -> None:
        self.lib = _lib()
        self.reference = TorchAttention(prompt_dtype)
        self.prompt_kernel = prompt_dtype is None and prompt_kernel_fits()
        self._scores = torch.empty(0)
        self._scratch = torch.empty(0)

    def prepare(self, meta: AttentionMetadata) -> None:
        # NOTE: with the prompt kernel, a prompt span takes it whatever its length, so a prompt
        # row rounds alike in a whole prompt and in the few tokens a prefix-cache hit or a
        # chunk leaves (batch_invariant); short spans of generated rows (decodes, speculative
        # verifications) take the decode kernel, as a one-token step's row does
        prompt = self.prompt_kernel and meta.prompt_spans is not None and any(meta.prompt_spans)
        if max(meta.query_lens) <= SHORT_SPAN and not prompt:
            meta.plan = token_rows(meta)
        elif self.prompt_kernel:
            meta.plan = _span_plan(meta)
        else:
            self.reference.prepare(meta)

    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        plan = meta.plan
        if isinstance(plan, tuple):
            return self._decode(q, cache, layer, meta, *plan)
        if not isinstance(plan, _SpanPlan):
            return self.reference.forward(q, cache, layer, meta)
        q = q.contiguous()
        out = torch.empty_like(q)
        if plan.rows is not None:
            out[plan.rows] = self._decode(q[plan.rows], cache, layer, meta, plan.tables, plan.lens)
        kc, vc = cache.k[layer], cache.v[layer]  # [kv_heads, blocks, block_size, head_dim]
        _, heads, dim = q.shape
        for q_start, q_end, table, ctx in plan.spans:
            need = self.lib.pdserve_prompt_attention_scratch(ctx, heads, kc.shape[0], dim)
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need)
            self.lib.pdserve_prompt_attention(
                q[q_start].data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[1] * kc.shape[2],
                table.data_ptr(), ctx, q_end - q_start, heads, kc.shape[0], dim,
                meta.block_size, meta.sliding_window or 0, dim**-0.5, out[q_start].data_ptr(),
                self._scratch.data_ptr(), cache.format_code,
            )  # fmt: skip
        return out

    def _decode(
        self,
        q: torch.Tensor,
        cache: KVCache,
        layer: int,
        meta: AttentionMetadata,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        kc, vc = cache.k[layer], cache.v[layer]  # [kv_heads, blocks, block_size, row]
        b, heads, dim = q.shape
        # one kv head's query group's scores, then the context rows' offsets (int64)
        need = (heads // kc.shape[0] + 2) * meta.max_seq_len + 2
        if self._scores.numel() < need:
            self._scores = torch.empty(max(need, 4096))
        q = q.contiguous()
        out = torch.empty_like(q)
        self.lib.pdserve_decode_attention(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[1] * kc.shape[2],
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), b, heads,
            kc.shape[0], dim, meta.block_size, meta.sliding_window or 0, dim**-0.5,
            out.data_ptr(), self._scores.data_ptr(), cache.format_code,
        )  # fmt: skip
        return out


def _span_plan(meta: AttentionMetadata) -> _SpanPlan:
    starts = meta.query_start_loc.tolist()
    prompt = meta.prompt_spans or [False] * meta.num_seqs
    by_kernel = [n > SHORT_SPAN or p for n, p in zip(meta.query_lens, prompt)]
    short = [i for i, k in enumerate(by_kernel) if not k]
    spans = [
        (starts[i], starts[i] + n, meta.block_tables[i].contiguous(), ctx)
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens))
        if by_kernel[i]
    ]
    rows = [r for i in short for r in range(starts[i], starts[i] + meta.query_lens[i])]
    tables, lens = token_rows(meta, short)
    return _SpanPlan(torch.tensor(rows) if rows else None, tables, lens, spans)


class CpuOps:
    def __init__(self) -> None:
        self.lib = _lib()

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 or bf16 (a packed GEMM's kept result; residual then fp32); the output in
        fp32 or ``out_dtype`` bf16, rounded once in the kernel."""
        x = x.contiguous()
        t, n = x.shape
        res = torch.empty((t, n), dtype=torch.float32)
        out = torch.empty((t, n), dtype=out_dtype or torch.float32)
        r = 0 if residual is None else residual.contiguous().data_ptr()
        self.lib.pdserve_add_rms_norm(
            x.data_ptr(), x.dtype == torch.bfloat16, r, weight.data_ptr(), t, n, eps,
            out.data_ptr(), out.dtype == torch.bfloat16, res.data_ptr(),
        )  # fmt: skip
        return out, res

    def rope_tables(
        self, positions: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return positions, rotary.cos, rotary.sin

    def rope_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: object,
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos, sin = rope  # type: ignore[misc]
        t, heads, dim = q.shape
        kc, vc = cache.k[layer], cache.v[layer]
        self.lib.pdserve_rope_and_cache(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            t, heads, k.shape[1], dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            kc.data_ptr(), vc.data_ptr(), kc.shape[1] * kc.shape[2], slot_mapping.data_ptr(),
            cache.format_code,
        )  # fmt: skip
        return q, k  # rotated in place

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """fp32, or bf16 (the packed GEMM's result on AMX hosts: computed in fp32, rounded
        once)."""
        gate_up = gate_up.contiguous()
        t, two_i = gate_up.shape
        out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
        kernel = (
            self.lib.pdserve_silu_and_mul_bf16
            if gate_up.dtype == torch.bfloat16
            else self.lib.pdserve_silu_and_mul
        )
        kernel(gate_up.data_ptr(), t, two_i // 2, out.data_ptr())
        return out


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the cpu backend can run this model here (fp32, kernels built)."""
    return dtype == torch.float32 and head_dim <= MAX_HEAD_DIM and library.load() is not None
