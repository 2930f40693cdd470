"""``redistribute``: any placement transition, as a table.

==============  ==============  ==========================  ==========================
from            to              forward                     backward (autograd)
==============  ==============  ==========================  ==========================
Shard           Replicate       all_gather                  reduce_scatter
Partial         Shard           reduce_scatter              all_gather
Partial         Replicate       all_reduce                  all_reduce
Replicate       Shard           keep this rank's chunk      zero-extend (a Partial)
Shard           Partial         zero-extend to T rows       keep this rank's chunk
Replicate       Partial         rank 0 keeps, others zero   rank 0's gradient
same            same            identity                    identity
==============  ==============  ==========================  ==========================

The last three need no communication. ``Varying`` has no global tensor and
takes part in no transition; ``Shard(d)`` only goes to ``Shard(d)``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..types import layout
from ..types.errors import SPMDLayoutError
from ..types.mesh import MeshLike
from ..types.placement import Partial, Placement, Replicate, Shard, Varying
from ..types.tensor import SPMDTensor
from ._common import expect, result
from .allreduce import all_reduce
from .gather_scatter import all_gather, reduce_scatter


def _chunk(x: SPMDTensor, dst: Placement) -> SPMDTensor:
    """Replicate -> Shard: this rank's chunk-rule rows (a view)."""
    a, total = x.axis, x.global_tokens
    local = x.local.narrow(x.token_dim, layout.chunk_offset(total, a.size, a.rank), layout.local_tokens(total, a.size, a.rank))
    return result(x, local, Shard(x.token_dim))


def _zero_extend(x: SPMDTensor, dst: Placement) -> SPMDTensor:
    """Shard -> Partial: this rank's rows at their offset, zeros elsewhere (sum = the tensor)."""
    a, total, d = x.axis, x.global_tokens, x.token_dim
    before = layout.chunk_offset(total, a.size, a.rank)
    after = total - before - x.local_tokens
    pad = [0, 0] * (x.local.dim() - 1 - d) + [before, after]
    return result(x, F.pad(x.local, pad), Partial())


class _ZerosLike(torch.autograd.Function):
    """Zeros that stay in the autograd graph (the input's gradient is zero, not None)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros_like(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros_like(grad)


def _rank0_keeps(x: SPMDTensor, dst: Placement) -> SPMDTensor:
    """Replicate -> Partial: rank 0's copy is the sum, the others contribute zeros."""
    return result(x, x.local if x.axis.rank == 0 else _ZerosLike.apply(x.local), Partial())


Transition = Callable[[SPMDTensor, Placement], SPMDTensor]

TRANSITIONS: dict[tuple[type, type], Transition] = {
    (Shard, Replicate): lambda x, dst: all_gather(x),
    (Partial, Shard): lambda x, dst: reduce_scatter(x),
    (Partial, Replicate): lambda x, dst: all_reduce(x),
    (Replicate, Shard): _chunk,
    (Shard, Partial): _zero_extend,
    (Replicate, Partial): _rank0_keeps,
    **{(p, p): (lambda x, dst: x) for p in (Shard, Replicate, Partial)},  # same -> same: identity
}


def redistribute(x: SPMDTensor, placement: Placement, *, mesh: Optional[MeshLike] = None) -> SPMDTensor:
    """Move ``x`` to ``placement`` on the same mesh axis (see the module table).

    The token count travels with the type; a ``Shard`` target must name the
    tensor's token dim.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> x = spmdmoe.shard(torch.ones(3, 2), pg)
    >>> spmdmoe.redistribute(x, spmdmoe.Replicate()).placement
    Replicate()
    """
    # the target's problems go into the input check, so the collective-checking mode raises them on every rank
    # (the peers would otherwise go on into the transition's collective); the target itself is compared there
    step = TRANSITIONS.get((type(x.placement), type(placement))) if isinstance(x, SPMDTensor) else None
    expect(x, "redistribute", (Shard, Replicate, Partial, Varying), mesh, _target_problem(x, placement, step),
           {"target": repr(placement)})
    assert step is not None
    return step(x, placement)


def _target_problem(x: Any, placement: Placement, step: Optional[Transition]) -> Optional[SPMDLayoutError]:
    if not isinstance(x, SPMDTensor):
        return None  # the input check names it
    if step is None:
        return SPMDLayoutError(
            f"rank {x.axis.rank}: no transition from {x.placement} to {placement}: Varying tensors have no "
            "global tensor (use all_to_all), and the others move among Shard/Replicate/Partial"
        )
    if isinstance(placement, Shard) and placement.dim % max(x.local.dim(), 1) != x.token_dim:
        return SPMDLayoutError(
            f"rank {x.axis.rank}: redistribute to {placement} but the token dim of {x.placement} is "
            f"{x.token_dim}; shard along the token dim (Shard({x.token_dim})), or move dims with with_local"
        )
    return None
