"""Rotary position embeddings (HF "rotate half" layout) with default, linear and llama3 scaling,
and per-frequency factors (a GGUF's rope_freqs tensor)."""

from __future__ import annotations

import math

import torch

from services.engine.config import ModelConfig
from services.engine.errors import ModelLoadError


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "freq_factors":
        if len(rs.freq_factors) != inv.numel():
            raise ModelLoadError(
                f"rope freq_factors has {len(rs.freq_factors)} values; head_dim {dim} needs {inv.numel()}"
            )
        inv = inv / torch.tensor(rs.freq_factors, dtype=torch.float32)
    elif rs.rope_type == "llama3":
        old_ctx = rs.original_max_position_embeddings
        low_wavelen = old_ctx / rs.low_freq_factor
        high_wavelen = old_ctx / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old_ctx / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class Rotary:
    """cos/sin tables for every position up to ``max_positions``, computed once."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: str
    ) -> None:
        inv = inv_frequencies(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        self.sin = emb.sin().to(dtype=dtype, device=device)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
