"""Sizing the KV pool from device memory (CUDA): what is left of the operator's share of the
device once the weights are loaded and a full step's activations are set aside."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig, ModelConfig

# CUDA graph pools, cuBLAS workspaces and allocator slack beyond the activation estimate
FIXED_RESERVE_BYTES = 256 << 20


def activation_bytes(mc: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """An upper estimate of one step's transient device memory: the largest step's hidden
    states, projections and MLP intermediates, one layer's gathered context for attention and
    the fp32 logits of every sampled row; doubled for the allocator's fragmentation."""
    esize = torch.empty((), dtype=dtype).element_size()
    t = config.max_num_batched_tokens
    per_token = (
        4 * mc.hidden_size  # x, residual, normed, attention output
        + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim  # q | k | v
        + 3 * mc.intermediate_size  # gate | up, and silu(gate) * up
    )
    max_len = config.max_model_len or mc.max_position_embeddings
    context = 2 * max_len * mc.num_kv_heads * mc.head_dim  # k and v gathered for one sequence
    logits = config.max_num_seqs * mc.vocab_size * (4 + esize)
    return 2 * ((t * per_token + context) * esize + logits) + FIXED_RESERVE_BYTES


def blocks_for_memory(
    *, total: int, free: int, utilization: float, bytes_per_block: int, activation_bytes: int
) -> int:
    """KV blocks that fit in ``utilization * total`` beside what is in use now (weights, the
    CUDA context, other processes) and ``activation_bytes``.

    Raises:
        ValueError: not even one block fits; the message says how much memory is missing.
    """
    in_use = total - free
    budget = int(total * utilization) - in_use - activation_bytes
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: "
            f"{total / 2**30:.1f} GiB device, {in_use / 2**30:.1f} GiB in use, "
            f"{activation_bytes / 2**30:.1f} GiB reserved for activations; raise it or lower "
            "max_num_batched_tokens / max_num_seqs"
        )
    return int(blocks)
