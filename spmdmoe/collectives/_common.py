"""Shared pieces of the collectives: token-dim moves, padded send buffers, input checks.

Collectives work on "row tensors": the token dimension moved to dim 0 and
contiguous, so a rank's rows are one contiguous block. For ``token_dim == 0``
and a contiguous input that move is free; otherwise it costs one copy.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..collective_check import check_collective
from ..types.checks import _layout_problem, checks_mode
from ..types.errors import SPMDLayoutError, SPMDMeshError
from ..types.mesh import MeshLike, mesh_axis
from ..types.placement import Placement
from ..types.tensor import SPMDTensor


def rows_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with the token dim first and contiguous (free when it already is)."""
    return (t if dim == 0 else t.movedim(dim, 0)).contiguous()


def restore_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Undo :func:`rows_view`'s move (a view, no copy)."""
    return t if dim == 0 else t.movedim(0, dim)


def zero_padded(rows: torch.Tensor, padded: int) -> torch.Tensor:
    """``rows`` followed by zero rows up to ``padded``, for ``torch.compile``: written into a zero buffer,
    so no tensor's size is the pad count (a pad of 0 rows would specialise the traced graph on it)."""
    return rows.new_zeros((padded, *rows.shape[1:])).slice_scatter(rows, 0, 0, rows.shape[0])


def padded_rows(rows: torch.Tensor, padded: int) -> torch.Tensor:
    """``rows`` as a contiguous block of ``padded`` rows: no copy when already full.

    Otherwise one copy into an ``empty`` buffer; the tail rows are sent but
    never read by spmdmoe (receivers keep the first ``T`` rows).
    """
    if rows.shape[0] == padded and rows.is_contiguous():
        return rows
    send = rows.new_empty((padded, *rows.shape[1:]))
    send[: rows.shape[0]].copy_(rows)
    return send


def expect(x: SPMDTensor, op: str, allowed: tuple[type, ...], mesh: Optional[MeshLike],
           problem: Optional[Exception] = None, fields: Optional[dict[str, Any]] = None) -> None:
    """Check the input type of a collective (local checks on the type, no communication); ``problem``: one the
    caller found in its other arguments (raised after the input's own), ``fields``: more values the
    collective-checking mode compares. In that mode (:mod:`spmdmoe.collective_check`) the ranks first compare
    the input, so a problem found here on one rank is raised on every rank."""
    problem = _input_problem(x, op, allowed, mesh) or problem
    if checks_mode() == "collectives":
        if problem is None:  # also the rows this rank holds against its declared layout
            found = _layout_problem(x, x.placement, None, None)
            problem = None if found is None else SPMDLayoutError(f"{op}: {found}")
        axis = x.axis if isinstance(x, SPMDTensor) else mesh_axis(mesh) if mesh is not None else None
        if axis is not None:
            check_collective(op, axis, x, problem, fields)
            return
    if problem is not None:
        raise problem


def _input_problem(x: SPMDTensor, op: str, allowed: tuple[type, ...], mesh: Optional[MeshLike]
                   ) -> Optional[SPMDLayoutError]:
    if not isinstance(x, SPMDTensor):
        return SPMDLayoutError(
            f"{op} takes an SPMDTensor, found {type(x).__name__}; wrap it with spmdmoe.from_local(t, mesh, ...)"
        )
    if not isinstance(x.placement, allowed):
        names = " or ".join(f"{a.__name__}" for a in allowed)
        return SPMDLayoutError(
            f"rank {x.axis.rank}: {op} takes a {names} tensor, found {x.placement}; "
            f"use spmdmoe.redistribute(x, ...) for other transitions"
        )
    if mesh is not None and mesh_axis(mesh) != x.axis:
        return SPMDMeshError(
            f"rank {x.axis.rank}: {op} was asked to run on {mesh_axis(mesh)} but the tensor lives on "
            f"{x.axis}; redistribute on the tensor's own mesh axis, or build it on this one"
        )
    return None


def result(
    x: SPMDTensor, local: torch.Tensor, placement: Placement, buffer: Optional[torch.Tensor] = None
) -> SPMDTensor:
    """A trusted SPMDTensor with ``x``'s axis, token dim and token count."""
    return SPMDTensor._new(local, x.axis, placement, x._global_tokens, x.token_dim, buffer)
