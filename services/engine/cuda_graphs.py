"""Decode steps as CUDA graphs: one capture per batch-size bucket, replayed with padded inputs.

A decode step at small batch is a few hundred kernel launches that each run for microseconds,
so eager execution is bound by the host. A graph replays the whole step with one launch.

How it works:
1. Static device buffers hold the step's inputs (block-table rows, start positions, token
   ids) for the largest bucket. A step of n sequences takes the smallest bucket b >= n; rows
   n..b-1 are padding: they use the padding row of the block tables (every entry the scratch
   block) at position 0, so they read and write only the scratch block.
2. Each bucket's graph is captured once (largest first, sharing one memory pool), after two
   warm-up runs on a side stream (which also compile the Triton kernels).
3. A replay copies the packed inputs into the static buffers (one copy), replays, and returns
   the first n rows of the static logits. NOTE: the returned logits are a view of the graph's
   output buffer: consume them (sample) before the next replay.

On CPU (and with ``capture=False``) the same padded path runs eagerly: it is the CPU twin
that tests pad handling, and it gives the same tokens as the unpadded step.
Graphs need a backend whose launches read sizes from device tensors only (``graph_safe``);
kernel grids are sized by ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.backend import Backend
from services.engine.kv_cache import KVCache
from services.engine.model import LlamaModel
from services.engine.scheduler import ScheduledSpan
from services.engine.step_state import StepInputs, StepState


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_batch`` (which is always included)."""
    out = [b for b in (1, 2, 4) if b < max_batch]
    out += list(range(8, max_batch, 8))
    return [*out, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        state: StepState,
        backend: Backend,
        max_batch: int,
        capture: bool,
    ) -> None:
        if capture and not backend.graph_safe:
            raise ValueError(
                f"CUDA graphs need a graph-safe attention backend; {backend.name!r} is not "
                "(use 'triton', or turn cuda_graphs off)"
            )
        self.model = model
        self.cache = cache
        self.state = state
        self.backend = backend
        self.buckets = batch_buckets(max_batch)
        self.capture = capture
        dev = state.device
        b = self.buckets[-1]
        # [3, max_bucket] int64: block-table row, start position, token id of each sequence
        self.static = torch.zeros((3, b), dtype=torch.int64, device=dev)
        self.static[0] = state.tables.padding_row
        self.q_lens = torch.ones(b, dtype=torch.int64, device=dev)
        self.sampled = torch.arange(b, dtype=torch.int64, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: object | None = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, spans: Sequence[ScheduledSpan]) -> torch.Tensor:
        """Logits [len(spans), vocab] of a pure decode step (every span one new token)."""
        n = len(spans)
        b = self.bucket(n)
        live = {s.request.request_id for s in spans}
        tables, blocks = self.state.tables, self.state.blocks
        pad = b - n
        rows = [
            tables.row(s.request.request_id, blocks.block_table(s.request.request_id), live)
            for s in spans
        ]
        starts = [s.start for s in spans]
        ids = [s.request.token_ids[s.start] for s in spans]
        host = torch.tensor(
            [rows + [tables.padding_row] * pad, starts + [0] * pad, ids + [0] * pad],
            dtype=torch.int64,
        )
        ctx = [a + 1 for a in starts] + [1] * pad
        tables.flush()
        if self.static.device.type == "cpu":
            self.static[:, :b] = host
        else:
            self.static[:, :b].copy_(host.pin_memory(), non_blocking=True)
        if not self.capture:
            return self._forward(b, ctx)[:n]
        graph, out = self._graphs.get(b) or self._capture(b)
        graph.replay()
        return out[:n]

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (they share the largest one's pool)."""
        if self.capture:
            for b in reversed(self.buckets):
                if b not in self._graphs:
                    self._capture(b)

    def _inputs(self, b: int, ctx: list[int]) -> StepInputs:
        st = self.state
        return st._inputs(
            self.static[0, :b],
            self.static[1, :b],
            self.q_lens[:b],
            self.static[2, :b],
            self.sampled[:b],
            [1] * b,
            ctx,
            max_seq_len=st.max_model_len,
            width=st.tables.device_tables.shape[1],
        )

    def _forward(self, b: int, ctx: list[int]) -> torch.Tensor:
        inp = self._inputs(b, ctx)
        return self.model.forward(
            inp.input_ids,
            inp.positions,
            self.cache,
            inp.meta,
            self.backend,
            inp.logits_idx,
        )

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # NOTE: the host lengths are only an upper bound here (the graph is replayed for any
        # lengths); the graph-safe backend sizes its grids by max_model_len, not by them.
        ctx = [self.state.max_model_len] * b
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: Triton compiles, allocator settles
                self._forward(b, ctx)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b, ctx)
        self._pool = graph.pool()
        self._graphs[b] = (graph, out)
        return graph, out
