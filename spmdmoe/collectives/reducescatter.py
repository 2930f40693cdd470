"""``reduce_scatter``: Partial (T rows) -> Shard(tokens) under the chunk rule."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dist import reduce_scatter_single
from ..types import layout
from ..types.mesh import MeshAxis, MeshLike
from ..types.placement import Partial, Shard
from ..types.tensor import SPMDTensor
from ._common import differentiable, expect, padded_rows, restore_dim, result, rows_view


def scatter_padded(local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:
    """Sum of every rank's ``p * n`` rows, this rank's ``p``-row block (no autograd)."""
    p = layout.padded_local_tokens(total, axis.size)
    rows = rows_view(local, dim)
    out = rows.new_empty((p, *rows.shape[1:]))
    if p:
        send = buffer if buffer is not None and dim == 0 else padded_rows(rows, p * axis.size)
        reduce_scatter_single(out, send, group=axis.group)
    return restore_dim(out, dim)


class _ReduceScatter(torch.autograd.Function):
    """Sum ``p * n`` rows over ranks, keep this rank's ``p``; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (axis, total, dim)
        return scatter_padded(local, buffer, axis, total, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        from .allgather import gather_padded_op

        axis, total, dim = ctx.meta
        full = gather_padded_op(grad, None, axis, layout.padded_global_tokens(total, axis.size), dim)
        return full.narrow(dim, 0, total), None, None, None, None


scatter_padded_op = differentiable(_ReduceScatter, scatter_padded)


def reduce_scatter(x: SPMDTensor, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Partial (T rows on every rank) -> Shard(tokens) with the chunk rule.

    Per rank: sends ``padded_global_tokens`` rows, receives the sum over ranks
    of its ``padded_local_tokens``-row block through one
    ``reduce_scatter_single`` (``reduce_scatter_tensor``), keeps the valid
    ``local_tokens`` rows. The result is backed by the received block
    (``.buffer``), so gathering it again needs no padding copy.

    Padding: when ``T`` is not a multiple of the axis size, the ``T`` rows are
    copied into an ``empty`` buffer of ``padded_global_tokens`` rows (the
    tail's sums land in rows that are dropped); a ``Partial`` whose
    ``.buffer`` already has the padded rows (see :func:`spmdmoe.padded_empty`)
    is sent without any copy, and so is an even, contiguous input.

    Backward: all-gather of the gradient rows (the gradient of each rank's
    summand is the whole gradient).

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> y = spmdmoe.reduce_scatter(spmdmoe.from_local(torch.ones(3, 2), pg, placement=spmdmoe.Partial()))
    >>> y.placement, y.local_tokens
    (Shard(dim=0), 3)
    """
    expect(x, "reduce_scatter", (Partial,), mesh)
    total, dim = x.global_tokens, x.token_dim
    padded = scatter_padded_op(x.local, x.buffer, x.axis, total, dim)
    rows = layout.local_tokens(total, x.axis.size, x.axis.rank)
    local = padded if padded.shape[dim] == rows else padded.narrow(dim, 0, rows)
    return result(x, local, Shard(dim), padded if dim == 0 else None)
