"""``all_gather``: Shard(tokens) -> Replicate, with exactly ``global_tokens`` rows."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dist import all_gather_single
from ..types import layout
from ..types.mesh import MeshAxis, MeshLike
from ..types.placement import Replicate, Shard
from ..types.tensor import SPMDTensor
from ._common import differentiable, expect, padded_rows, restore_dim, result, rows_view


def gather_padded(local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:
    """Every rank's ``p`` rows into one ``p * n``-row tensor (no autograd)."""
    p, n = layout.padded_local_tokens(total, axis.size), axis.size
    rows = rows_view(local, dim)
    out = rows.new_empty((p * n, *rows.shape[1:]))
    if p:
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
    return restore_dim(out, dim)


class _AllGather(torch.autograd.Function):
    """Gather ``p`` rows from every rank into ``p * n`` rows; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, buffer: Optional[torch.Tensor], axis: MeshAxis, total: int, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (axis, total, dim)
        return gather_padded(local, buffer, axis, total, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        from .reducescatter import scatter_padded_op

        axis, total, dim = ctx.meta
        padded = scatter_padded_op(grad, None, axis, layout.padded_global_tokens(total, axis.size), dim)
        rows = layout.local_tokens(total, axis.size, axis.rank)
        return padded.narrow(dim, 0, rows), None, None, None, None


gather_padded_op = differentiable(_AllGather, gather_padded)


def all_gather(x: SPMDTensor, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Shard(tokens) -> Replicate: every rank gets all ``global_tokens`` rows.

    Per rank: sends ``padded_local_tokens`` rows and receives
    ``padded_global_tokens`` rows through one ``all_gather_single``
    (``all_gather_into_tensor``); the result is the view ``[:T]`` of that buffer.

    Padding: only a rank holding fewer than ``padded_local_tokens`` rows copies
    its rows (at most one such rank under the chunk rule, plus ranks with no
    rows): on CUDA straight into its slot of the output, gathered in place; on
    CPU into an ``empty`` send buffer. Full ranks send their tensor as is, and a
    ``Shard`` backed by a padded ``buffer`` (a ``reduce_scatter`` result,
    :func:`spmdmoe.padded_empty`) is sent without a copy. A token dim other
    than 0 costs a copy to move it first.

    Backward: reduce-scatter (sum) of the gradient (a ``Replicate``'s gradient
    is ``Partial``) back to this rank's rows, padded the same way.

    ``mesh``, if given, must be the tensor's own axis (else ``SPMDMeshError``).

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.all_gather(spmdmoe.shard(torch.ones(5, 2), pg)).local.shape
    torch.Size([5, 2])
    """
    expect(x, "all_gather", (Shard,), mesh)
    total, dim = x.global_tokens, x.token_dim
    out = gather_padded_op(x.local, x.buffer, x.axis, total, dim)
    if out.shape[dim] != total:
        out = out.narrow(dim, 0, total)
    return result(x, out, Replicate())
