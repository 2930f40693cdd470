"""``reduce_scatter``: Partial (T rows) -> Shard(tokens) under the chunk rule."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dist import reduce_scatter_list, reduce_scatter_single
from ..types import layout
from ..types.mesh import MeshAxis, MeshLike
from ..types.placement import Partial, Shard
from ..types.tensor import SPMDTensor
from ._common import differentiable, expect, restore_dim, result, rows_view


def scatter_padded(local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:
    """Sum over ranks of this rank's chunk (no autograd).

    Returns the ``p``-row block (tensor path: ``T`` divides evenly, or a
    pre-padded ``buffer``) or exactly this rank's ``local_tokens`` rows (the
    uneven path: a list reduce-scatter over row views of the input, no copy).
    """
    n = axis.size
    p = layout.padded_local_tokens(total, n)
    rows = rows_view(local, dim)
    if p == 0:
        return restore_dim(rows.new_empty((0, *rows.shape[1:])), dim)
    if (buffer is not None and dim == 0) or p * n == total:
        out = rows.new_empty((p, *rows.shape[1:]))
        reduce_scatter_single(out, buffer if buffer is not None and dim == 0 else rows, group=axis.group)
        return restore_dim(out, dim)
    counts = layout.chunk_counts(total, n)
    views = list(rows.split(counts))
    out = rows.new_empty((counts[axis.rank], *rows.shape[1:]))
    reduce_scatter_list(out, views, group=axis.group)
    return restore_dim(out, dim)


class _ReduceScatter(torch.autograd.Function):
    """Sum the chunks over ranks, keep this rank's; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (axis, total, dim)
        return scatter_padded(local, buffer, axis, total, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        from .allgather import gather_padded_op

        axis, total, dim = ctx.meta
        p = layout.padded_local_tokens(total, axis.size)
        # a p-row block gathers as full chunks; exact rows gather under the chunk rule
        gather_total = p * axis.size if grad.shape[dim] == p else total
        full = gather_padded_op(grad, None, axis, gather_total, dim)
        return full.narrow(dim, 0, total), None, None, None, None


scatter_padded_op = differentiable(_ReduceScatter, scatter_padded)


def reduce_scatter(x: SPMDTensor, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Partial (T rows on every rank) -> Shard(tokens) with the chunk rule.

    Per rank: sends ``padded_global_tokens`` rows, receives the sum over ranks
    of its ``padded_local_tokens``-row block through one
    ``reduce_scatter_single`` (``reduce_scatter_tensor``), keeps the valid
    ``local_tokens`` rows. The result is backed by the received block
    (``.buffer``), so gathering it again needs no padding copy.

    Padding: none is ever copied. An even ``T`` (a multiple of the axis size)
    or a ``Partial`` whose ``.buffer`` already has the padded rows (see
    :func:`spmdmoe.padded_empty`) goes through ``reduce_scatter_single`` as is,
    and the result is backed by the received ``p``-row block (``.buffer``), so
    gathering it again needs no padding copy. An uneven ``T`` goes through the
    list form of ``reduce_scatter`` on row views of the input, one per rank's
    chunk (NCCL runs it as grouped reduces; measured on 2x H200 at least as
    fast as the padded tensor collective, see ``benchmarks/RESULTS.md``).

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
    block = scatter_padded_op(x.local, x.buffer, x.axis, total, dim)
    rows = layout.local_tokens(total, x.axis.size, x.axis.rank)
    local = block if block.shape[dim] == rows else block.narrow(dim, 0, rows)
    padded = dim == 0 and block.shape[0] == x.padded_local_tokens
    return result(x, local, Shard(dim), block if padded else None)
