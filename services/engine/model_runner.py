"""Turns a scheduled step into device inputs, runs the model, and returns next-token logits.

Pure decode steps go through ``DecodeGraphs`` when CUDA graphs are on (captured once per
batch-size bucket, replayed with padded inputs), and on CPU through ``FusedDecode`` (every
layer in one C call) where it applies; prefill and mixed steps run op by op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.backend import Backend
from services.engine.cpu_decode import FusedDecode
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.kv_cache import KVCache
from services.engine.model import LayerHook, LlamaModel
from services.engine.row_roles import ALL_GENERATED
from services.engine.scheduler import ScheduledSpan
from services.engine.step_state import StepState


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        state: StepState,
        backend: Backend,
        graphs: DecodeGraphs | None = None,
        fused: FusedDecode | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.state = state
        self.backend = backend
        self.graphs = graphs
        self.fused = fused

    def run(
        self, spans: Sequence[ScheduledSpan], layer_hook: LayerHook | None = None
    ) -> torch.Tensor:
        """Computes KV for every span; returns fp32 logits [rows, vocab]: each sampling span's
        rows in span order, then the rows scoring prompt tokens (``prompt_positions``)."""
        if (
            self.graphs is not None
            and layer_hook is None
            and all(s.num_new == 1 and not s.prompt_positions for s in spans)
            and self.graphs.fits(len(spans))
        ):
            return self.graphs.run(spans)
        inp = self.state.build(spans)
        # NOTE: the fused step runs every row by the decode kernels: with roles (batch
        # invariance) only a step of generated rows may take it
        verify = any(s.draft for s in spans)
        if (
            self.fused is not None
            and layer_hook is None
            and self.fused.fits(inp.meta, verify)
            and (inp.roles is None or inp.roles.all_generated)
        ):
            hidden = self.fused.run(inp.input_ids, inp.positions, inp.meta)
            # NOTE: a verification step's rows take the decode kernels in the lm_head too,
            # as a plain one-token step's row does (by step size, 5 rows would not)
            roles = inp.sampled_roles or (ALL_GENERATED if verify else None)
            return self.model.lm_head(hidden[inp.logits_idx], roles).float()
        return self.model.forward(
            inp.input_ids,
            inp.positions,
            self.cache,
            inp.meta,
            self.backend,
            inp.logits_idx,
            layer_hook,
            inp.roles,
            inp.sampled_roles,
            inp.tail,
        )
