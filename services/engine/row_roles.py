"""Which kernel computes a row of a step: by the step's size (fastest) or by the row's role
(batch-invariant).

By default a linear layer picks its kernel by the number of rows in the call: the quantized
decode kernels up to ``KERNEL_ROWS``, oneDNN's packed GEMM above. Fastest, but a row's
rounding then depends on what else is in its step, so a seeded request's tokens can change
with load, and a resumed request's replay can disagree with what its client already has.

With ``RowRoles`` (``batch_invariant``) a layer picks by the row's role instead: prompt rows
run the packed GEMM (prefill speed), generated rows (inputs that were sampled: decodes,
speculative drafts, a recomputed request's outputs) the decode kernels, whatever the batch.
Each kernel computes every row on its own (measured: a row's output is bit-identical for any
number of rows and any offset), and the CPU attention computes each query row on its own, so
a row's output depends on its input and its context alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RowRoles:
    """The rows of a step's activations by role: prompt tokens, or generated ones (decode
    inputs, speculative drafts, a recomputed request's outputs)."""

    all_generated: bool  # a step of one role: every row generated, or (False) every row prompt
    # a step of both roles: (prompt rows, generated rows), int64 indices on the device
    split: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, generated: Sequence[bool], device: torch.device | str) -> RowRoles:
        if all(generated) or not any(generated):
            return cls(all(generated))
        gen = torch.tensor(generated, dtype=torch.bool)
        idx = torch.arange(len(generated))
        return cls(False, (idx[~gen].to(device), idx[gen].to(device)))


ALL_GENERATED = RowRoles(True)


def by_role(
    x: torch.Tensor,
    roles: RowRoles,
    prompt: Callable[[torch.Tensor], torch.Tensor],
    generated: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``prompt(rows)`` for the prompt rows and ``generated(rows)`` for the others, in order."""
    if roles.split is None:
        return generated(x) if roles.all_generated else prompt(x)
    p, g = roles.split
    yp = prompt(x.index_select(0, p))
    y = yp.new_empty((x.shape[0], yp.shape[1]))
    y.index_copy_(0, p, yp)
    y.index_copy_(0, g, generated(x.index_select(0, g)))
    return y
