"""``all_reduce``: Partial -> Replicate (sum)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._dist import all_reduce as _dist_all_reduce
from ..types.mesh import MeshAxis, MeshLike
from ..types.placement import Partial, Replicate
from ..types.tensor import SPMDTensor
from ..autograd import collective_op, written
from ._common import expect, result


def summed(local: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """A fresh tensor holding the sum over ranks (no autograd; the input is untouched)."""
    out = local.clone(memory_format=torch.contiguous_format)
    if out.numel():
        _dist_all_reduce(out, group=axis.group)
    return written(out)


class _AllReduce(torch.autograd.Function):
    """Sum over ranks into a fresh tensor; the backward is the same sum."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, axis: MeshAxis, grad_leaf: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.axis = axis
        return summed(local, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return summed_op(grad, ctx.axis), None, None


summed_op = collective_op(_AllReduce, summed)


def all_reduce(x: SPMDTensor, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Partial -> Replicate: every rank gets the sum of all ranks' summands.

    Per rank: one copy of the ``T`` valid rows (the input is never modified),
    then one in-place ``all_reduce`` (sum) of that copy. No padding.

    Backward: all-reduce (sum) of the incoming gradients: a ``Replicate``
    tensor's gradient is ``Partial`` (docs/design.md §4), so the gradient of each
    summand is the sum of every rank's gradient. A Megatron-style "identity
    backward" all-reduce is a different op and is not this one. The backward is
    recorded on every rank whenever grad mode is on (``spmdmoe.autograd``).

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.all_reduce(spmdmoe.from_local(torch.ones(2, 2), pg, placement=spmdmoe.Partial())).placement
    Replicate()
    """
    expect(x, "all_reduce", (Partial,), mesh)
    return result(x, summed_op(x.local, x.axis), Replicate())
