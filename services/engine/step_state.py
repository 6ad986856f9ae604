"""Device-resident step state: the block tables of running requests and each step's inputs.

A step used to rebuild every sequence's block table and every token's slot as Python lists
(O(tokens) host work and copies). Here the block tables live in one persistent device tensor,
one row per running request, and are updated incrementally: a request's row is written when it
is admitted, then only the entries of blocks it newly takes. Each step the host sends one small
int64 tensor (rows, start positions and query lengths of the sequences, the new tokens' ids and
the rows to sample), O(batch) for decodes, and the device derives positions, slots, sequence
lengths and query offsets from it.

Invariants:
- a row's entries ``[0, synced)`` equal the request's block table (tables only grow; a table
  that is a new list object belongs to a re-admission and is written from the start);
- rows of requests that are not running are reclaimed only when a row is needed;
- row ``max_seqs`` is the padding row: every entry is the scratch block, so padded sequences
  (CUDA graph buckets) read and write only the scratch block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.attention import AttentionMetadata
from services.engine.block_manager import BlockManager
from services.engine.row_roles import ALL_GENERATED, RowRoles
from services.engine.scheduler import ScheduledSpan


@dataclass(slots=True)
class _Row:
    index: int
    table: list[int]  # the block manager's list for this admission (identity matters)
    synced: int


@dataclass(slots=True)
class TailRows:
    """The rows a step's last layer computes past its keys and values: each span's rows from
    its first one whose logits are needed (sampled or scoring a prompt token) to its end.

    Every row's keys and values are needed in every layer (they go to the cache), but a row's
    output of the last layer feeds only its own logits: a prompt chunk of 1,024 rows that
    samples 4 needs the last layer's attention, o-projection and MLP for those 4 alone.
    Invariant: ``rows`` holds every row ``logits_idx`` of the step names, in step order."""

    rows: torch.Tensor  # [m] int64: the step's rows kept, in order
    meta: AttentionMetadata  # the kept rows' spans (their last ``m_i`` query rows)
    logits_idx: torch.Tensor  # [num_logits] int64: the step's logits rows, as tail rows
    roles: RowRoles | None = None  # of the kept rows (batch_invariant); None: by size


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    logits_idx: torch.Tensor  # [num_sampled] int64: rows whose next-token logits are needed
    meta: AttentionMetadata
    # the rows' roles (batch-invariant kernel choice, services.engine.row_roles), and those of
    # the rows logits_idx names; None: kernels chosen by batch size
    roles: RowRoles | None = None
    sampled_roles: RowRoles | None = None
    tail: TailRows | None = None  # None: the last layer computes every row


class BlockTables:
    """Block tables of running requests: one persistent [max_seqs + 1, max_blocks] int32
    tensor on the device, mirrored on the host and synced by the changed entries only."""

    def __init__(
        self, max_seqs: int, max_blocks: int, scratch_block: int, device: torch.device | str
    ) -> None:
        self.device = torch.device(device)
        self.max_seqs = max_seqs
        self.padding_row = max_seqs
        self.host = torch.full((max_seqs + 1, max_blocks), scratch_block, dtype=torch.int32)
        self.on_host = self.device.type == "cpu"
        self.device_tables = self.host if self.on_host else self.host.to(self.device)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(max_seqs - 1, -1, -1))
        self._pending: list[tuple[int, int, list[int]]] = []  # (row, first column, values)

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def row(self, request_id: str, table: list[int], live: set[str]) -> int:
        """The row of ``request_id`` with its table synced; ``live``: this step's requests,
        whose rows must not be reclaimed."""
        r = self._rows.get(request_id)
        if r is None:
            r = self._rows[request_id] = _Row(self._take(live), table, 0)
        elif r.table is not table or r.synced > len(table):
            r.table, r.synced = table, 0  # re-admitted (after a preemption): a new table
        if r.synced < len(table):
            new = table[r.synced :]
            self.host[r.index, r.synced : len(table)] = torch.tensor(new, dtype=torch.int32)
            if not self.on_host:
                self._pending.append((r.index, r.synced, new))
            r.synced = len(table)
        return r.index

    def release(self, request_id: str) -> None:
        r = self._rows.pop(request_id, None)
        if r is not None:
            self._free.append(r.index)

    def flush(self) -> None:
        """Send the entries written since the last flush to the device (one small copy)."""
        if not self._pending:
            return
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for row, first, values in self._pending:
            rows.extend([row] * len(values))
            cols.extend(range(first, first + len(values)))
            vals.extend(values)
        self._pending.clear()
        idx = torch.tensor([rows, cols, vals], dtype=torch.int32)
        if self.device.type == "cuda":
            idx = idx.pin_memory()  # an asynchronous copy needs pinned memory
        idx = idx.to(self.device, non_blocking=True)
        self.device_tables[idx[0].long(), idx[1].long()] = idx[2]

    def _take(self, live: set[str]) -> int:
        if not self._free:
            for rid in [rid for rid in self._rows if rid not in live]:
                self.release(rid)
        if not self._free:
            raise RuntimeError("more sequences in one step than block-table rows (max_num_seqs)")
        return self._free.pop()


class StepState:
    """Builds each step's device inputs from the scheduled spans and the persistent tables."""

    def __init__(
        self,
        blocks: BlockManager,
        max_seqs: int,
        max_model_len: int,
        scratch_block: int,
        device: torch.device | str,
        sliding_window: int | None,
        batch_invariant: bool = False,
    ) -> None:
        self.blocks = blocks
        self.batch_invariant = batch_invariant
        self.block_size = blocks.block_size
        self.device = torch.device(device)
        self.sliding_window = sliding_window
        self.max_model_len = max_model_len
        self.tables = BlockTables(
            max_seqs, -(-max_model_len // self.block_size), scratch_block, device
        )

    def build(self, spans: Sequence[ScheduledSpan]) -> StepInputs:
        live = {s.request.request_id for s in spans}
        rows: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        ids: list[int] = []
        sampled: list[int] = []
        scored: list[int] = []  # rows scoring prompt tokens (prompt_logprobs), after sampled
        keep: list[int] = []  # per span: its last rows the last layer computes (TailRows)
        for s in spans:
            req = s.request
            rows.append(
                self.tables.row(req.request_id, self.blocks.block_table(req.request_id), live)
            )
            starts.append(s.start)
            q_lens.append(s.num_new)
            first = len(ids)
            ids.extend(s.token_ids() if s.draft else req.token_ids[s.start : s.start + s.num_new])
            sampled.extend(range(len(ids) - s.num_sampled, len(ids)))
            positions = s.prompt_positions
            scored.extend(first + p - s.start for p in positions)
            keep.append(max(s.num_sampled, s.start + s.num_new - positions[0] if positions else 0))
        sampled += scored
        self.tables.flush()
        n_seqs, n_tok = len(rows), len(ids)
        packed = self._send(rows + starts + q_lens + ids + sampled)
        rows_t, starts_t, q_lens_t, ids_t, sampled_t = packed.split(
            (n_seqs, n_seqs, n_seqs, n_tok, len(sampled))
        )
        ctx = [a + n for a, n in zip(starts, q_lens)]
        inputs = self._inputs(rows_t, starts_t, q_lens_t, ids_t, sampled_t, q_lens, ctx)
        inputs.meta.prompt_spans = [s.start + s.num_new <= s.request.num_prompt for s in spans]
        gen: list[bool] | None = None
        if self.batch_invariant:
            inputs.roles, inputs.sampled_roles, gen = self._roles(spans, sampled)
        if sum(keep) < n_tok:
            inputs.tail = self._tail(inputs.meta, rows, starts, q_lens, ctx, keep, sampled, gen)
        return inputs

    def _tail(
        self,
        meta: AttentionMetadata,
        rows: list[int],
        starts: list[int],
        q_lens: list[int],
        ctx: list[int],
        keep: list[int],
        logits_rows: list[int],
        gen: list[bool] | None,
    ) -> TailRows:
        """``TailRows`` of a step whose span i keeps its last ``keep[i]`` rows."""
        kept: list[int] = []
        end = 0
        for n, k in zip(q_lens, keep):
            end += n
            kept.extend(range(end - k, end))
        seqs = [i for i, k in enumerate(keep) if k]
        where = {r: j for j, r in enumerate(kept)}
        m = len(seqs)
        rows_t, starts_t, q_lens_t, kept_t, logits_t = self._send(
            [rows[i] for i in seqs]
            + [starts[i] + q_lens[i] - keep[i] for i in seqs]
            + [keep[i] for i in seqs]
            + kept
            + [where[r] for r in logits_rows]
        ).split((m, m, m, len(kept), len(logits_rows)))
        if seqs:  # NOTE: the kept rows stand in for the ids: only their number is read
            tail_meta = self._inputs(
                rows_t, starts_t, q_lens_t, kept_t, kept_t[:0], [keep[i] for i in seqs],
                [ctx[i] for i in seqs],
            ).meta  # fmt: skip
            assert meta.prompt_spans is not None
            tail_meta.prompt_spans = [meta.prompt_spans[i] for i in seqs]
        else:  # nothing is kept: the last layer stops at its keys and values
            tail_meta = meta
        roles = None
        if self.batch_invariant:
            roles = (
                ALL_GENERATED if gen is None else RowRoles.of([gen[r] for r in kept], self.device)
            )
        return TailRows(kept_t, tail_meta, logits_t, roles)

    def _send(self, values: list[int]) -> torch.Tensor:
        """One int64 tensor of ``values`` on the device (one host-to-device copy)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t if self.device.type == "cpu" else t.to(self.device)

    def _roles(
        self, spans: Sequence[ScheduledSpan], sampled: list[int]
    ) -> tuple[RowRoles, RowRoles, list[bool] | None]:
        """Row i is generated when its position is past its request's prompt; also that list
        (None for a step of decodes, whose rows are all generated)."""
        if all(s.start >= s.request.num_prompt for s in spans):  # decodes: O(1) per span
            return ALL_GENERATED, ALL_GENERATED, None
        gen: list[bool] = []
        for s in spans:
            gen.extend(p >= s.request.num_prompt for p in range(s.start, s.start + s.num_new))
        roles = RowRoles.of(gen, self.device)
        return roles, RowRoles.of([gen[i] for i in sampled], self.device), gen

    def _inputs(
        self,
        rows: torch.Tensor,  # [num_seqs] int64
        starts: torch.Tensor,  # [num_seqs] int64
        q_lens: torch.Tensor,  # [num_seqs] int64
        ids: torch.Tensor,  # [num_tokens] int64
        sampled: torch.Tensor,  # [num_sampled] int64
        q_lens_host: list[int],
        ctx_host: list[int],
        max_seq_len: int | None = None,
        width: int | None = None,
    ) -> StepInputs:
        """Device-side derivation; no host sync (so a CUDA graph may capture it too)."""
        bs = self.block_size
        n_seqs, n_tok = rows.shape[0], ids.shape[0]
        if width is None:
            width = -(-max(ctx_host) // bs)
        tables = self.tables.device_tables[:, :width].index_select(0, rows)  # [num_seqs, width]
        qsl = torch.zeros(n_seqs + 1, dtype=torch.int32, device=ids.device)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        if n_tok == n_seqs:  # pure decode: token i is sequence i's only query
            positions = starts
            blk = tables.gather(1, (positions // bs)[:, None])[:, 0]
        else:
            seq = torch.repeat_interleave(
                torch.arange(n_seqs, device=ids.device), q_lens, output_size=n_tok
            )
            positions = starts[seq] + torch.arange(n_tok, device=ids.device) - qsl[seq]
            blk = tables[seq, positions // bs]
        meta = AttentionMetadata(
            slot_mapping=blk.long() * bs + positions % bs,
            block_tables=tables,
            seq_lens=(starts + q_lens).to(torch.int32),
            query_start_loc=qsl,
            query_lens=q_lens_host,
            context_lens=ctx_host,
            block_size=bs,
            sliding_window=self.sliding_window,
            max_seq_len=max_seq_len if max_seq_len is not None else max(ctx_host),
        )
        return StepInputs(ids, positions, sampled, meta)
