"""Weight-only quantized weights in groups of 32 along the input dim, and their linear layer.

Formats (see ``cpu_kernels/kernels.c`` for the byte layout and the arithmetic):
- ``q4``: 4-bit values with a scale and a min per group: ``w = d * q + m``. GGUF Q4_0, Q4_1 and
  Q4_K load into it exactly (their per-32 scales and mins are products of their own fields).
- ``q8``: 8-bit values with a scale per group: ``w = d * q``. GGUF Q8_0 loads into it exactly.
Float checkpoints are quantized on load when asked (``quantization: int8 | int4``).

``QuantLinear`` computes with pdserve's C kernels (``cpu_kernels``) for up to ``KERNEL_ROWS``
rows: decode and small batches, where a step is bound by reading the weights, so reading 4 or 8
bits per weight instead of 32 is the gain. The kernels read a blocked copy made at load
(``blocked``: 16 output rows interleaved per group, unpacked once and used by every row of the
batch); the canonical ``QuantWeight`` is not kept beside it. Larger batches (prefill) are
compute-bound; there it uses oneDNN on a copy packed at load in the matmul dtype (``pack``:
fp32, or bf16 where the CPU computes it natively), and otherwise the kernels in slices of
``MAX_ROWS`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from services.engine.cpu_kernels import library
from services.engine.packed_gemm import packed_gemm
from services.engine.row_roles import RowRoles, by_role

QK = 32
# NOTE: the measured crossover with oneDNN's packed GEMM, by the kernels' SIMD path and the
# packed copy's dtype: above this many rows the packed GEMM is faster (SmolLM2's 120 linears,
# one core). AVX2 kernels: fp32 above 16 rows; AMX bf16 above 4 (16.3 vs 15.0 ms at 4 rows,
# 18.8 vs 26.9 ms at 8). AVX512-VNNI kernels, on a Zen 4 core with AVX512-BF16: never within
# the kernels' 32 rows (bf16: 25.4 vs 30.3 ms at 16 rows, 47.6 vs 47.0 at 32 for the linears
# alone; and a step of 17-32 rows fused into one C call, FusedDecode, saves its per-op
# overhead: 24 and 32 concurrent requests of bench/engine_bench.py's load, 347-374 -> 392-410
# tok/s).
# AVX512-VNNI kernels beside AMX: not measured yet; 8 rows, where the kernels (2.5x a row's
# time at 8 rows on Zen 4) stay under the AMX GEMM's bf16 weight read (18.8 ms at 8 rows).
KERNEL_ROWS = {
    "avx512-vnni": {torch.float32: 32, torch.bfloat16: 32, torch.float16: 32},
    "avx512-vnni+amx": {torch.float32: 32, torch.bfloat16: 8, torch.float16: 8},
    "avx2": {torch.float32: 16, torch.bfloat16: 4, torch.float16: 4},
}


def kernel_rows(pack: torch.dtype | None) -> int:
    """Rows up to which the quantized kernels beat the packed GEMM (all, when not packed)."""
    if pack is None:
        return 1 << 30
    from services.engine.precision import cpu_has_amx  # NOTE: precision imports this module

    level = library.simd_level()
    if level == "avx512-vnni" and cpu_has_amx():
        level = "avx512-vnni+amx"
    return KERNEL_ROWS.get(level, KERNEL_ROWS["avx2"])[pack]


MAX_IN_FEATURES = 16384  # the kernels' per-group sums live on their stack
MAX_ROWS = 32  # rows per kernel call (MAX_ROWS in kernels.c)
Kind = Literal["q4", "q8"]


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A ``[out, in]`` weight in groups of 32 along ``in``."""

    kind: Kind
    qs: torch.Tensor  # q4: [out, in / 2] uint8 nibbles; q8: [out, in] int8
    d: torch.Tensor  # [out, in / 32] fp32 scales
    m: torch.Tensor | None  # q4: [out, in / 32] fp32 mins; q8: None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def values(self) -> torch.Tensor:
        """The integer values, ``[out, in]`` (q4: 0..15 in int16; q8: int8)."""
        if self.kind == "q8":
            return self.qs
        g = self.qs.view(self.d.shape[0], -1, 16).to(torch.int16)
        return torch.cat((g & 15, g >> 4), dim=-1).reshape(self.shape)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``[out, in]`` (or only ``rows``, e.g. an embedding lookup)."""
        q = self.values() if rows is None else self._sub(rows).values()
        d = self.d if rows is None else self.d[rows]
        w = q.float().view(d.shape[0], -1, QK) * d[..., None]
        if self.m is not None:
            w = w + (self.m if rows is None else self.m[rows])[..., None]
        return w.view(d.shape[0], -1)

    def _sub(self, rows: torch.Tensor) -> QuantWeight:
        return QuantWeight(self.kind, self.qs[rows], self.d[rows], None)

    def permute_rows(self, perm: torch.Tensor) -> QuantWeight:
        m = None if self.m is None else self.m[perm].contiguous()
        return QuantWeight(self.kind, self.qs[perm].contiguous(), self.d[perm].contiguous(), m)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack along ``out`` (fused q|k|v and gate|up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different formats: {sorted(kinds)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
        return QuantWeight(
            parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
        )

    @classmethod
    def from_float(cls, w: torch.Tensor, kind: Kind) -> QuantWeight:
        """Round-to-nearest quantization of a float ``[out, in]`` weight (``in % 32 == 0``)."""
        out, inp = w.shape
        if inp % QK:
            raise ValueError(f"input dim {inp} is not a multiple of {QK}")
        g = w.detach().float().reshape(out, inp // QK, QK)
        if kind == "q8":
            d = g.abs().amax(-1) / 127
            q = torch.round(g / torch.where(d > 0, d, 1)[..., None]).clamp(-127, 127)
            return cls("q8", q.to(torch.int8).reshape(out, inp), d.contiguous(), None)
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo) / 15
        q = torch.round((g - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]).clamp(0, 15)
        q = q.to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        return cls(
            "q4", packed.reshape(out, inp // 2).contiguous(), d.contiguous(), lo.contiguous()
        )


# ---- GGUF blocks -> QuantWeight ------------------------------------------------------------
def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def from_gguf(raw: np.ndarray, type_name: str, rows: int, cols: int) -> QuantWeight | None:
    """Raw GGUF bytes ``[rows, bytes per row]`` of a quantized tensor; None for a type that has
    no exact ``QuantWeight`` form (the caller dequantizes it)."""
    g = cols // QK
    if type_name == "Q8_0":
        b = raw.reshape(rows, g, 34)
        qs = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, cols))
        return QuantWeight("q8", qs, _f16(b[..., :2]).reshape(rows, g), None)
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(rows, g, size)
        d = _f16(b[..., :2]).reshape(rows, g)
        m = -8 * d if type_name == "Q4_0" else _f16(b[..., 2:4]).reshape(rows, g)
        qs = torch.from_numpy(np.ascontiguousarray(b[..., size - 16 :]).reshape(rows, cols // 2))
        return QuantWeight("q4", qs, d, m)
    if type_name == "Q4_K":
        return _from_q4_k(raw, rows, cols)
    return None


def _from_q4_k(raw: np.ndarray, rows: int, cols: int) -> QuantWeight:
    # block of 256: d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    # 128 bytes of nibbles: chunk j of 64 holds sub-block 2j in low and 2j+1 in high nibbles
    nb = cols // 256
    b = raw.reshape(rows, nb, 144)
    d = _f16(b[..., 0:2]).reshape(rows, nb, 1)
    dmin = _f16(b[..., 2:4]).reshape(rows, nb, 1)
    s = b[..., 4:16].astype(np.int32)
    sc = np.empty((rows, nb, 8), dtype=np.int32)
    mn = np.empty((rows, nb, 8), dtype=np.int32)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    q = b[..., 16:].reshape(rows, nb, 4, 32)
    vals = np.stack((q & 15, q >> 4), axis=3).reshape(rows, nb * 8, QK)  # [rows, groups, 32]
    packed = vals[..., :16] | (vals[..., 16:] << 4)
    scale = (d * torch.from_numpy(sc.astype(np.float32))).reshape(rows, nb * 8)
    mins = (-dmin * torch.from_numpy(mn.astype(np.float32))).reshape(rows, nb * 8)
    qs = torch.from_numpy(np.ascontiguousarray(packed.astype(np.uint8)).reshape(rows, cols // 2))
    return QuantWeight("q4", qs, scale.contiguous(), mins.contiguous())


# ---- the kernels' layout -------------------------------------------------------------------
BLOCK = 16  # output rows per block of the kernels' layout


@dataclass(frozen=True, slots=True)
class BlockedWeight:
    """A ``QuantWeight`` in the kernels' layout (``cpu_kernels/kernels.c``, header): per block
    of 16 output rows and group of 32 inputs, the 16 x 32 values interleaved so one load holds
    every output's pair of weights (2p, 2p + 1); scales and mins per (block, group, row). Rows
    past the weight's own in the last block are zero."""

    kind: Kind
    qb: torch.Tensor  # q4: [blocks, groups, 256] uint8; q8: [blocks, groups, 512] int8
    db: torch.Tensor  # [blocks, groups, 16] fp32
    mb: torch.Tensor | None  # q4: [blocks, groups, 16] fp32; q8: None

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.qb, self.db, self.mb) if t is not None
        )


def blocked(w: QuantWeight) -> BlockedWeight:
    n, k = w.shape
    g, nb = k // QK, -(-n // BLOCK)
    pad = nb * BLOCK - n

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [n, g] -> [blocks, groups, 16]
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.view(nb, BLOCK, g).permute(0, 2, 1).contiguous()

    v = torch.nn.functional.pad(w.values().to(torch.int16), (0, 0, 0, pad)).view(nb, BLOCK, g, QK)
    if w.kind == "q4":
        # byte (c, n, e): low nibble w[n][2c + e], high nibble w[n][16 + 2c + e]
        lo, hi = v[..., :16].reshape(nb, BLOCK, g, 8, 2), v[..., 16:].reshape(nb, BLOCK, g, 8, 2)
        b = (lo | (hi << 4)).to(torch.uint8)
        qb = b.permute(0, 2, 3, 1, 4).reshape(nb, g, 256).contiguous()
        assert w.m is not None
        return BlockedWeight("q4", qb, per_row(w.d), per_row(w.m))
    # byte (p, n, e): w[n][2p + e]
    qb = v.reshape(nb, BLOCK, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512)
    return BlockedWeight("q8", qb.to(torch.int8).contiguous(), per_row(w.d), None)


# ---- the linear layer ------------------------------------------------------------------------
class QuantLinear:
    """``y = x @ W.T + b`` over a ``QuantWeight`` (fp32 activations in and out)."""

    def __init__(self, w: QuantWeight, bias: torch.Tensor | None, pack: torch.dtype | None) -> None:
        lib = library.load()
        if lib is None:
            raise RuntimeError(library.load_error())
        self.lib = lib
        self.bias = bias
        self.out_features, self.in_features = w.shape
        if self.in_features > MAX_IN_FEATURES:
            raise ValueError(f"input dim {self.in_features} > {MAX_IN_FEATURES} (kernel limit)")
        self.packed = packed_gemm(w.dequantize(), pack)
        self.kernel_rows = kernel_rows(pack)
        # NOTE: only the kernels' layout is kept (the canonical one would double the bytes)
        self.w = blocked(w)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + (self.bias.numel() * 4 if self.bias is not None else 0)

    def __call__(
        self, x: torch.Tensor, roles: RowRoles | None = None, *, keep: bool = False
    ) -> torch.Tensor:
        """By the number of rows (None), or prompt rows packed and generated rows by the
        kernels (``roles``): see ``services.engine.row_roles``. ``keep``: the packed GEMM's
        result in its own dtype (without roles only)."""
        if roles is not None:
            prompt = self._invariant_gemm if self.packed is not None else self._kernels
            return by_role(x, roles, prompt, self._kernels)
        if self.packed is not None and x.shape[0] > self.kernel_rows:
            return self.packed(x, self.bias, invariant=False, keep=keep, out_dtype=torch.float32)
        return self._kernels(x)

    def input_dtype(self, rows: int, roles: RowRoles | None) -> torch.dtype | None:
        """See ``LinearLayer.input_dtype``: the packed GEMM's dtype where ``__call__`` (by
        size) gives it the call."""
        if roles is not None or self.packed is None or rows <= self.kernel_rows:
            return None
        return self.packed.dtype if self.packed.dtype != torch.float32 else None

    def _invariant_gemm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None
        return self.packed(x, self.bias, invariant=True)

    def _kernels(self, x: torch.Tensor) -> torch.Tensor:
        rows, dtype = x.shape[0], x.dtype
        x = x.float().contiguous()
        y = torch.empty((rows, self.out_features), dtype=torch.float32)
        for a in range(0, rows, MAX_ROWS):
            self._kernel(x[a : a + MAX_ROWS], y[a : a + MAX_ROWS])
        if self.bias is not None:
            y.add_(self.bias)
        return y if dtype == torch.float32 else y.to(dtype)

    def _kernel(self, x: torch.Tensor, y: torch.Tensor) -> None:
        m, k = x.shape
        w = self.w
        if w.kind == "q4":
            assert w.mb is not None
            self.lib.pdserve_q4_gemm(
                x.data_ptr(),
                m,
                k,
                w.qb.data_ptr(),
                w.db.data_ptr(),
                w.mb.data_ptr(),
                self.out_features,
                y.data_ptr(),
            )
        else:
            self.lib.pdserve_q8_gemm(
                x.data_ptr(),
                m,
                k,
                w.qb.data_ptr(),
                w.db.data_ptr(),
                self.out_features,
                y.data_ptr(),
            )
