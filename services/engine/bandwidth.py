"""The device's streaming read rate, measured once: what a bandwidth-bound decode step's floor
is computed from (bytes of weights one step reads / this rate)."""

from __future__ import annotations

import time

import torch

_BYTES = 64 << 20  # a matrix-vector product over this much fp32: read once per pass


def read_gbps(device: str = "cpu") -> float:
    """GB/s of one thread (CPU; the engine's own thread count) or one device (CUDA): the best
    of three passes of a matrix-vector product, which reads its matrix once."""
    dev = torch.device(device)
    w = torch.ones((_BYTES // 4 // 4096, 4096), device=dev)
    x = torch.ones((1, 4096), device=dev)
    best = float("inf")
    for _ in range(3):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t)
    return _BYTES / best / 1e9
