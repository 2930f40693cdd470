"""DTensor interop: ``from_dtensor``, ``to_dtensor`` and a module adapter.

Placements map one to one on a single mesh axis:

===================  ======================  ==========================================
DTensor              spmdmoe                 gradient convention at the boundary
===================  ======================  ==========================================
``Shard(d)``         ``Shard(d)``            the same: each rank's rows
``Replicate()``      ``Replicate()``         DTensor: every rank holds the whole
                                             gradient; spmdmoe: each rank a summand
                                             (``Partial``). Converted both ways.
``Partial("sum")``   ``Partial()``           the same: each summand's gradient is the
                                             whole gradient
===================  ======================  ==========================================

Anything else (``_StridedShard``, ``_MaskPartial``, other reduce ops, a token
dim sharded over several mesh dims) is rejected with ``SPMDLayoutError``.

``from_dtensor`` never trusts a DTensor's global shape blindly: DTensor infers ``local x world`` when ``from_local``
gets no ``shape=`` (pytorch#110762), and accepts non-chunk splits when it does get one (pytorch#144109). The check is
:func:`spmdmoe.from_local`'s: one check exchange of 8 int64 per rank and one host transfer, and every rank raises
together. A DTensor made by :func:`to_dtensor` carries its verified layout and skips it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from .construct import _from_local, from_local
from .types.errors import SPMDLayoutError
from .types.layout import contiguous_strides
from .types.mesh import mesh_axis
from .types.placement import Partial, Placement, Replicate, Shard, Varying
from .types.tensor import SPMDTensor

__all__ = ["from_dtensor", "to_dtensor", "DTensorAdapter"]

# Set on DTensors built by to_dtensor: the layout they came from is verified. New DTensors that
# DTensor ops produce do not carry it, so they are checked again.
_VERIFIED = "_spmdmoe_verified"


class _ReplicaGradAsSummand(torch.autograd.Function):
    """Identity; backward turns DTensor's Replicate gradient (the whole gradient on every
    rank) into spmdmoe's Partial one (rank 0 holds it, the others zero): summed, it is exact."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.rank = rank
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return (grad if ctx.rank == 0 else torch.zeros_like(grad)), None


def _unsupported(dt: DTensor) -> Optional[str]:
    """Why ``dt``'s placements cannot map to spmdmoe's (``None``: they can)."""
    for p in dt.placements:
        if type(p) not in (DShard, DReplicate, DPartial) or (type(p) is DPartial and p.reduce_op != "sum"):
            return (f"from_dtensor supports Shard, Replicate and Partial('sum') placements, found {p!r}; "
                    "redistribute the DTensor to one of them first")
    return None


def _axis_and_placement(dt: DTensor) -> tuple[Any, Any]:
    """The (mesh, DTensor placement) of the one mesh dim that is not Replicate (or a 1-D mesh)."""
    mesh: DeviceMesh = dt.device_mesh
    placements = list(dt.placements)
    active = [i for i, p in enumerate(placements) if type(p) is not DReplicate]
    if mesh.ndim == 1:
        return mesh, placements[0]
    if len(active) > 1:
        raise SPMDLayoutError(
            f"from_dtensor maps one mesh axis; this DTensor is split over mesh dims {active} "
            f"({placements}); redistribute so that only one mesh dim is not Replicate"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise SPMDLayoutError("from_dtensor needs named mesh dims for an N-D mesh (init_device_mesh(..., mesh_dim_names=...))")
    i = active[0] if active else 0
    return mesh[names[i]], placements[i]


def from_dtensor(dt: DTensor, *, token_dim: int = 0, check: bool = True) -> SPMDTensor:
    """The ``SPMDTensor`` of a DTensor, with the exact global token count, verified on all ranks.

    ``token_dim`` is the token dimension for Replicate / Partial DTensors (a Shard uses its own dim). The global token
    count is the DTensor's global size along the token dim; every rank's local rows are checked against the chunk rule
    for it, collectively (see the module docstring for the cost). ``check=False`` trusts the DTensor (use only for
    DTensors built with explicit, correct ``shape=``). Autograd flows through, with the gradient convention converted
    (module table).
    """
    if not isinstance(dt, DTensor):
        raise SPMDLayoutError(f"from_dtensor takes a DTensor, found {type(dt).__name__}")
    known = getattr(dt, _VERIFIED, False)
    mesh, dplace = _axis_and_placement(dt)
    unsupported = _unsupported(dt)
    if unsupported is not None:  # raised on every rank of the axis, in from_local's exchange (its peers are there)
        if known or not check:
            raise SPMDLayoutError(unsupported)
        local = dt.to_local()
        total = dt.shape[token_dim] if -dt.dim() <= token_dim < dt.dim() else None
        _from_local(local, mesh, Replicate(), total, False, token_dim,
                    ("placement", f"rank {dist.get_rank()}: {unsupported}"))
        raise SPMDLayoutError(unsupported)  # not reached: the exchange raised this rank's problem
    if type(dplace) is DShard:
        placement: Placement = Shard(dplace.dim)
        grad_placements = list(dt.placements)
    elif type(dplace) is DReplicate:
        placement, grad_placements = Replicate(), [DPartial() if type(p) is DReplicate and p is dplace else p for p in dt.placements]
    else:
        placement, grad_placements = Partial(), [DReplicate() if p is dplace else p for p in dt.placements]
    dim = placement.dim if isinstance(placement, Shard) else token_dim
    local = dt.to_local(grad_placements=grad_placements)
    total = dt.shape[dim]
    if known or not check:
        axis = mesh_axis(mesh)
        return SPMDTensor._new(local, axis, placement, total, dim % local.dim())
    try:
        return from_local(local, mesh, placement=placement, global_tokens=total, token_dim=token_dim)
    except SPMDLayoutError as e:  # raised on every rank together: add what DTensor assumed
        raise type(e)(
            f"from_dtensor: the DTensor says global size {total} along dim {dim} with placement {dplace}; "
            f"where its shards do not form that chunk layout, note that DTensor.from_local without shape= infers "
            f"global = local x world (wrong when the split is uneven): build it with shape= and stride= "
            f"of the real global tensor, or make it with spmdmoe.to_dtensor.\n{e}"
        ) from None


def to_dtensor(x: SPMDTensor) -> DTensor:
    """A DTensor with explicit ``shape=`` and ``stride=`` (DTensor never infers), sharing ``x.local``.

    Round trips with :func:`from_dtensor` are exact for every token count, including ``T`` smaller than the axis size.
    ``Varying`` has no DTensor equivalent and raises ``SPMDLayoutError``. An axis given as a ``ProcessGroup`` gets a
    ``DeviceMesh`` built on that group.
    """
    if not isinstance(x, SPMDTensor):
        raise SPMDLayoutError(f"to_dtensor takes an SPMDTensor, found {type(x).__name__}")
    if isinstance(x.placement, Varying):
        raise SPMDLayoutError(
            f"rank {x.axis.rank}: a Varying tensor has no global tensor, so no DTensor; redistribute or "
            "wrap its rows with from_local(..., placement=Shard(0)) first"
        )
    mesh = x.axis.device_mesh()  # a ProcessGroup axis gets a DeviceMesh built on its group
    local = x.local
    if isinstance(x.placement, Shard):
        dplace: Any = DShard(x.placement.dim)
    elif isinstance(x.placement, Replicate):
        dplace, local = DReplicate(), _ReplicaGradAsSummand.apply(local, x.axis.rank)
    else:
        dplace = DPartial()
    shape = x.global_shape
    dt = DTensor.from_local(local, mesh, [dplace], run_check=False, shape=shape, stride=contiguous_strides(shape))
    setattr(dt, _VERIFIED, True)
    return dt


class DTensorAdapter(nn.Module):
    """Call a ``parallelize_moe`` layer from a model whose activations are DTensors.

    ``forward(dt)`` converts with :func:`from_dtensor` (checked unless it came from :func:`to_dtensor`), runs the layer
    and returns a DTensor with the input's placements and global shape. Parameters keep their names under ``layer.``.
    ``dt``: for a layer with ``sp_mesh``, a ``(tokens, dim)`` DTensor ``Shard(0)`` on that mesh (the layer's rows:
    flatten ``(batch, seq, dim)`` activations and redistribute them to ``Shard(0)`` first); for an EP-only layer
    (no ``sp_mesh``), any DTensor whose local ``(tokens, dim)`` rows are this rank's batch.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, dt: DTensor) -> DTensor:
        if getattr(self.layer, "sp", None) is None:
            rows = self.layer(dt.to_local())
            return DTensor.from_local(rows, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())
        return to_dtensor(self.layer(from_dtensor(dt)))
