"""Turns a scheduled step into tensors, runs the model, and returns next-token logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.attention import AttentionBackend, SeqSpan, build_metadata
from services.engine.block_manager import BlockManager
from services.engine.kv_cache import KVCache
from services.engine.model import LayerHook, LlamaModel
from services.engine.scheduler import ScheduledSpan


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        blocks: BlockManager,
        attention: AttentionBackend,
        device: str,
    ) -> None:
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.attention = attention
        self.device = device

    def run(
        self, spans: Sequence[ScheduledSpan], layer_hook: LayerHook | None = None
    ) -> torch.Tensor:
        """Computes KV for every span; returns fp32 logits [num sampling spans, vocab] in span order."""
        ids: list[int] = []
        positions: list[int] = []
        seq_spans: list[SeqSpan] = []
        logits_idx: list[int] = []
        for s in spans:
            end = s.start + s.num_new
            ids.extend(s.request.token_ids[s.start : end])
            positions.extend(range(s.start, end))
            seq_spans.append(
                SeqSpan(s.start, s.num_new, self.blocks.block_table(s.request.request_id))
            )
            if s.samples:
                logits_idx.append(len(ids) - 1)
        meta = build_metadata(
            seq_spans, self.cache.block_size, self.device, self.model.cfg.sliding_window
        )
        dev = self.device
        return self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.cache,
            meta,
            self.attention,
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
            layer_hook,
        )
