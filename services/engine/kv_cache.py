"""The paged KV pool: one preallocated key tensor and one value tensor per layer."""

from __future__ import annotations

import ctypes

import torch

from services.engine import kv_quant
from services.engine.cpu_kernels import library
from services.engine.host_buffers import HOST_BUFFERS


def empty_bytes(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised 1-D uint8 tensor for a large buffer written once and read soon
    (received KV, an export). NOTE: on the host it comes from ``HOST_BUFFERS``: a buffer
    returned by an earlier transfer is warm, and a fresh one is numpy's memory, which asks
    the kernel for huge pages (a fresh 50 MB buffer fills about 2x faster than
    ``torch.empty``'s 4 KiB faults here)."""
    if torch.device(device).type == "cpu":
        return HOST_BUFFERS.take(n)
    return torch.empty(n, dtype=torch.uint8, device=device)


class KVCache:
    """Preallocated paged KV storage.

    Layout per layer: ``[num_kv_heads, num_blocks, block_size, row]`` (``row`` = head_dim
    values, or for int8 the quantized row of ``kv_quant``); token ``t`` of a
    request lives at slot ``block_table[t // block_size] * block_size + t % block_size`` of
    every head.
    NOTE: heads outermost so that gathering a batch's context yields ``[kv_heads, ..., ctx,
    head_dim]``, which attention consumes without another transpose copy.
    One more block than ``num_blocks`` is allocated: ``scratch_block``, owned by no request,
    where padded sequences of a CUDA-graph bucket write and read.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        kv_dtype: str | None = None,
    ) -> None:
        """``dtype``: what attention computes in (and reads back); ``kv_dtype``: the storage
        format (``services.engine.kv_quant``), None = ``dtype`` itself."""
        self.kv_dtype = kv_dtype or next(n for n, d in kv_quant.FLOAT_DTYPES.items() if d == dtype)
        row, storage = kv_quant.row_layout(self.kv_dtype, head_dim)
        self.quantized = self.kv_dtype == "int8"
        self.storage_dtype = storage
        # the C kernels' name for the rows (None: a format they do not read, e.g. float16)
        self.format_code = kv_quant.FORMAT_CODES.get(self.kv_dtype)
        self.dtype, self.head_dim = dtype, head_dim
        shape = (num_kv_heads, num_blocks + 1, block_size, row)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.k = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str
    ) -> int:
        """Device bytes one block takes over every layer, keys and values."""
        row, storage = kv_quant.row_layout(kv_dtype, head_dim)
        esize = torch.empty((), dtype=storage).element_size()
        return 2 * num_layers * block_size * num_kv_heads * row * esize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] keys or values as the cache stores them (rows of ``kv_quant``, or
        the storage dtype: rounded to nearest even)."""
        return kv_quant.quantize(x) if self.quantized else x.to(self.storage_dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; slots: [num_tokens] int64."""
        kc, vc = self.flat(layer)
        kc.index_copy_(1, slots, self.encode(k).transpose(0, 1))
        vc.index_copy_(1, slots, self.encode(v).transpose(0, 1))

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage views ``[num_kv_heads, num_blocks * block_size, row]`` of one layer's k
        and v (``row`` = head_dim for float formats)."""
        kc, vc = self.k[layer], self.v[layer]
        return kc.view(kc.shape[0], -1, kc.shape[3]), vc.view(vc.shape[0], -1, vc.shape[3])

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` ([n] int64), ``[num_kv_heads, n, head_dim]`` in the
        compute dtype (dequantized for int8, widened or rounded for another float)."""
        kc, vc = self.flat(layer)
        k, v = kc.index_select(1, slots), vc.index_select(1, slots)
        if self.quantized:
            return (
                kv_quant.dequantize(k, self.head_dim, self.dtype),
                kv_quant.dequantize(v, self.head_dim, self.dtype),
            )
        return k.to(self.dtype), v.to(self.dtype)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy out blocks (storage format): [num_layers, 2, len(block_ids), block_size, kv_heads, row]."""
        k0 = self.k[0]
        heads, _, block_size, head_dim = k0.shape
        idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        shape = (len(self.k), 2, len(block_ids), block_size, heads, head_dim)
        nbytes = torch.Size(shape).numel() * k0.element_size()
        out = empty_bytes(nbytes, k0.device).view(k0.dtype).view(shape)
        # NOTE: gathered one layer at a time through a small reused buffer, then transposed
        # into place: two passes over each byte, and no whole-request temporaries (stacking
        # the gathers made four copies, three of them into fresh, page-faulting memory)
        tmp = torch.empty(
            (heads, len(block_ids), block_size, head_dim), dtype=k0.dtype, device=k0.device
        )
        for layer, kv in enumerate(zip(self.k, self.v)):
            for i, cache in enumerate(kv):
                torch.index_select(cache, 1, idx, out=tmp)
                out[layer, i].copy_(tmp.permute(1, 2, 0, 3))
        return out

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks`` for ``data[:, :, i]`` -> block ``block_ids[i]`` (``data``
        may be a slice of a handle's blocks along dim 2)."""
        if not block_ids:
            return
        k0 = self.k[0]
        data = data.to(device=k0.device, dtype=k0.dtype)
        lib = library.load() if k0.device.type == "cpu" else None
        if lib is not None:
            # NOTE: one C pass of row copies (index_copy_ from the permuted view below took
            # 3.8x as long: 2.2 vs 0.57 ms for a 256-token request, inside the importing step)
            if not (data[0, 0].is_contiguous() and data.stride(0) == 2 * data.stride(1)):
                data = data.contiguous()
            ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in zip(self.k, self.v)]
            lib.pdserve_write_blocks(
                data.data_ptr(),
                data.stride(1) * data.element_size(),
                len(self.k),
                len(block_ids),
                self.block_size,
                k0.shape[0],
                k0.shape[3] * k0.element_size(),
                (ctypes.c_int32 * len(block_ids))(*block_ids),
                (ctypes.c_int64 * len(ptrs))(*(k for k, _ in ptrs)),
                (ctypes.c_int64 * len(ptrs))(*(v for _, v in ptrs)),
                k0.shape[1] * self.block_size,
            )
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        # [layers, 2, n, block_size, kv_heads, head_dim] -> [layers, 2, kv_heads, n, block_size, head_dim]
        data = data.permute(0, 1, 4, 2, 3, 5)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k.index_copy_(1, idx, data[layer, 0])
            v.index_copy_(1, idx, data[layer, 1])
