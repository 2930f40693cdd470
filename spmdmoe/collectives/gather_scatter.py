"""The dual pair ``all_gather`` (Shard -> Replicate) and ``reduce_scatter`` (Partial -> Shard).

Each one's backward is the other, on the same token count ``T`` (never re-derived from shapes). Which call runs
depends only on ``T`` and the axis size, never on rank-local state (a spare buffer, ``requires_grad``).

=================  ===============================================  ==========================
op                 per rank                                         padding
=================  ===============================================  ==========================
``all_gather``     sends ``p = ceil(T/n)`` rows, receives ``p*n``   a short rank copies its
                   (``all_gather_single``); result = view ``[:T]``  rows into a ``p``-row slot
``reduce_scatter`` ``T % n == 0``: ``reduce_scatter_single``;       none: uneven ``T`` uses the
                   else the list form on row views of the input     list form (NCCL: grouped
                   (one view per rank's chunk)                      reduces), no copy
=================  ===============================================  ==========================

Under ``torch.compile`` (functional collectives, one graph for every ``T``) both take the padded tensor form: ``p``
rows gathered, ``p*n`` summed, zeros appended where short (the traced collectives have no list form).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dist import all_gather_single, reduce_scatter_list, reduce_scatter_single
from ..autograd import collective_op, written
from ..types import layout
from ..types.mesh import MeshAxis, MeshLike
from ..types.placement import Partial, Replicate, Shard
from ..types.tensor import SPMDTensor
from ._common import expect, padded_rows, restore_dim, result, rows_view, zero_padded

__all__ = ["all_gather", "reduce_scatter", "gather_padded", "scatter_block"]


def gather_padded(local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:
    """Every rank's ``p`` rows into one ``p * n``-row tensor (no autograd)."""
    p, n = layout.padded_local_tokens(total, axis.size), axis.size
    rows = rows_view(local, dim)
    out = rows.new_empty((p * n, *rows.shape[1:]))
    if torch.compiler.is_compiling():  # one traced graph for every T: always pad (a no-op pad when full)
        all_gather_single(out, zero_padded(rows, p), group=axis.group)
    elif p:
        if buffer is not None and dim == 0:
            send = buffer  # a producer wrote into the padded buffer: no copy
        elif rows.shape[0] == p:
            send = rows  # a full rank sends its rows as they are
        elif rows.is_cuda:
            # the short rank writes its rows into its own slot and gathers in place (NCCL)
            send = out[axis.rank * p : (axis.rank + 1) * p]
            send[: rows.shape[0]].copy_(rows)
        else:
            send = padded_rows(rows, p)
        all_gather_single(out, send, group=axis.group)
    return restore_dim(written(out), dim)


def scatter_block(local: torch.Tensor, axis: MeshAxis, total: int, dim: int) -> torch.Tensor:
    """This rank's chunk of the sum over ranks, in a ``p``-row block (valid: its ``local_tokens`` rows), by the
    module docstring's rule; the block's spare tail lets a later gather skip its padding copy. No autograd."""
    n = axis.size
    p = layout.padded_local_tokens(total, n)
    rows = rows_view(local, dim)
    block = rows.new_empty((p, *rows.shape[1:]))
    if torch.compiler.is_compiling():  # one traced graph for every T (module docstring)
        reduce_scatter_single(block, zero_padded(rows, p * n), group=axis.group)
    elif p and p * n == total:
        reduce_scatter_single(block, rows, group=axis.group)
    elif p:
        counts = layout.chunk_counts(total, n)
        reduce_scatter_list(block[: counts[axis.rank]], list(rows.split(counts)), group=axis.group)
    return restore_dim(written(block), dim)


class _AllGather(torch.autograd.Function):
    """Gather ``p`` rows from every rank into ``p * n`` rows; backward reduce-scatters them (even)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int,  # type: ignore[override]
                dim: int, grad_leaf: torch.Tensor) -> torch.Tensor:
        ctx.meta = (axis, total, dim)
        return gather_padded(local, buffer, axis, total, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        axis, total, dim = ctx.meta
        block = scatter_block_op(grad, axis, layout.padded_global_tokens(total, axis.size), dim)
        return block.narrow(dim, 0, layout.local_tokens(total, axis.size, axis.rank)), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Sum the chunks over ranks, keep this rank's block; backward all-gathers under the chunk rule."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, axis: MeshAxis, total: int, dim: int,  # type: ignore[override]
                grad_leaf: torch.Tensor) -> torch.Tensor:
        ctx.meta = (axis, total, dim)
        return scatter_block(local, axis, total, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        axis, total, dim = ctx.meta
        rows = grad.narrow(dim, 0, layout.local_tokens(total, axis.size, axis.rank))
        return gather_padded_op(rows, None, axis, total, dim).narrow(dim, 0, total), None, None, None, None


gather_padded_op = collective_op(_AllGather, gather_padded)
scatter_block_op = collective_op(_ReduceScatter, scatter_block)


def all_gather(x: SPMDTensor, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Shard(tokens) -> Replicate: every rank gets all ``global_tokens`` rows.

    Per rank: sends ``padded_local_tokens`` rows and receives ``padded_global_tokens`` rows through one
    ``all_gather_single`` (``all_gather_into_tensor``); the result is the view ``[:T]`` of that buffer.

    Padding: only a rank holding fewer than ``padded_local_tokens`` rows copies its rows (at most one such rank
    under the chunk rule, plus ranks with no rows): on CUDA straight into its slot of the output, gathered in
    place; on CPU into an ``empty`` send buffer. Full ranks send their tensor as is, and a ``Shard`` backed by a
    padded ``buffer`` (a ``reduce_scatter`` result, :func:`spmdmoe.padded_empty`) is sent without a copy. A token
    dim other than 0 costs a copy to move it first.

    Backward: reduce-scatter (sum) of the gradient (a ``Replicate``'s gradient is ``Partial``) back to this rank's
    rows, recorded on every rank whenever grad mode is on. ``mesh``, if given, must be the tensor's own axis (else
    ``SPMDMeshError``).

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.all_gather(spmdmoe.shard(torch.ones(5, 2), pg)).local.shape
    torch.Size([5, 2])
    """
    expect(x, "all_gather", (Shard,), mesh)
    total, dim = x.global_tokens, x.token_dim
    out = gather_padded_op(x.local, x.buffer, x.axis, total, dim)
    if torch.compiler.is_compiling() or out.shape[dim] != total:  # traced: no guard on T
        out = out.narrow(dim, 0, total)
    return result(x, out, Replicate())


def reduce_scatter(x: SPMDTensor, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Partial (T rows on every rank) -> Shard(tokens) with the chunk rule.

    Per rank: contributes its ``T`` rows and receives the sum over ranks of its chunk. ``T % n == 0``: one
    ``reduce_scatter_single`` (``reduce_scatter_tensor``); otherwise the list form of ``reduce_scatter`` on row
    views of the input, one per rank's chunk (NCCL: grouped reduces).

    Padding: none is ever copied. The result is backed by a ``p``-row block (``.buffer``), so gathering it again
    needs no padding copy. Backward: all-gather of the gradient rows (each rank's summand's gradient is the whole
    gradient), recorded on every rank whenever grad mode is on.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> y = spmdmoe.reduce_scatter(spmdmoe.from_local(torch.ones(3, 2), pg, placement=spmdmoe.Partial()))
    >>> y.placement, y.local_tokens
    (Shard(dim=0), 3)
    """
    expect(x, "reduce_scatter", (Partial,), mesh)
    total, dim = x.global_tokens, x.token_dim
    block = scatter_block_op(x.local, x.axis, total, dim)
    rows = layout.local_tokens(total, x.axis.size, x.axis.rank)
    local = block if not torch.compiler.is_compiling() and block.shape[dim] == rows else block.narrow(dim, 0, rows)
    return result(x, local, Shard(dim), block if dim == 0 else None)
