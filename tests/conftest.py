"""Shared fixtures. One torch thread per process (see DEVELOPERS.md: 2 threads on 2 cores run
10-20x slower as soon as another process wants a core)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU tensors (their CPU twins); it must be set
    # before a kernel module is imported, since Triton reads it when @triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


pytest_plugins = ["tests.fixtures"]
