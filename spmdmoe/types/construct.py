"""Building ``SPMDTensor``s: ``shard``, ``from_local`` and ``padded_empty``.

``from_local`` verifies a layout across ranks with ONE small all-gather: each
rank sends eight int64 describing what it holds, every rank evaluates the same
rules on the same table, so a bad input makes every rank raise the same error
together (never one rank raising while the others wait in a collective).
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import torch

from .._dist import all_gather_single
from . import layout
from .checks import checks_enabled
from .errors import SPMDDeviceError, SPMDLayoutError, SPMDTokenCountError
from .mesh import MeshAxis, MeshLike, mesh_axis
from .placement import Partial, Placement, Replicate, Shard, Varying
from .tensor import SPMDTensor, _bad_rows_message, _buffer_rows, _check_token_dim, _check_total

__all__ = ["shard", "from_local", "padded_empty"]


def _strict_problem(total: int, axis: MeshAxis) -> Optional[str]:
    if total % axis.size == 0:
        return None
    return (
        f"rank {axis.rank}: strict=True needs global_tokens divisible by the axis size: found "
        f"global_tokens={total} on {axis.size} ranks ({total} % {axis.size} = {total % axis.size}); "
        f"pad the batch to {layout.padded_global_tokens(total, axis.size)} tokens or drop strict=True"
    )


def shard(x: torch.Tensor, mesh: MeshLike, *, dim: int = 0, strict: bool = False) -> SPMDTensor:
    """This rank's chunk of ``x`` along ``dim`` under the chunk rule. No communication.

    ``x`` is the full tensor, identical on every rank. The result's ``local`` is
    a view of ``x`` (autograd flows back to ``x``); with ``T = x.shape[dim]`` on
    ``n`` ranks, rank ``r`` holds rows ``[min(r*p, T), min((r+1)*p, T))`` with
    ``p = ceil(T/n)``: T=5 on 4 ranks gives 2, 2, 1, 0 rows.

    Raises ``SPMDMeshError`` (mesh not 1-D), ``SPMDLayoutError`` (``dim`` out of
    range; ``strict`` and ``T % n != 0``), ``SPMDDeviceError`` (``x`` on a device
    the backend cannot use). Every rank sees the same ``x``, so every rank raises.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.shard(torch.arange(10.).view(5, 2), pg).local_tokens
    5
    """
    axis = mesh_axis(mesh)
    d = _check_token_dim(x, Shard(dim), 0, axis)
    axis.check_device(x, "shard(x)")
    total = x.shape[d]
    if strict and (problem := _strict_problem(total, axis)) is not None:
        raise SPMDLayoutError(problem)
    start = layout.chunk_offset(total, axis.size, axis.rank)
    rows = layout.local_tokens(total, axis.size, axis.rank)
    return SPMDTensor._new(x.narrow(d, start, rows), axis, Shard(d), total, d)


def padded_empty(
    mesh: MeshLike,
    placement: Placement,
    global_tokens: int,
    row_shape: Sequence[int] = (),
    *,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
) -> SPMDTensor:
    """An uninitialised ``SPMDTensor`` backed by a buffer with the padded row count.

    Write the valid rows through ``.local`` (a view); a collective then sends
    ``.buffer`` without a padding copy. The token dimension is 0; ``row_shape``
    is the shape of one row. Spare rows are ``empty``: never read.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> y = spmdmoe.padded_empty(pg, spmdmoe.Partial(), 3, (4,))
    >>> y.local.shape, y.buffer.shape
    (torch.Size([3, 4]), torch.Size([3, 4]))
    """
    axis = mesh_axis(mesh)
    total = _check_total(global_tokens, axis)
    if isinstance(placement, Varying):
        raise SPMDLayoutError("Varying tensors have no padded layout: allocate them with torch.empty")
    rows = _buffer_rows(placement, total, axis)
    buf = torch.empty((rows, *row_shape), dtype=dtype, device=device)
    return SPMDTensor.from_buffer(buf, axis, placement, global_tokens=total)


# ---------------------------------------------------------------- from_local
# Each rank contributes one row of this table to the verification all-gather.
_FIELDS = ("problem", "declared", "rows", "kind", "token_dim", "signature", "strict", "bad_value")
_NO_T = -1
_KINDS = {Shard: 0, Replicate: 1, Partial: 2, Varying: 3}
# Local problems, in the order they are reported; each maps to the error type raised everywhere.
_LOCAL = {
    1: ("not a torch.Tensor", SPMDLayoutError),
    2: ("token dim out of range", SPMDLayoutError),
    3: ("global_tokens is not an int", SPMDTokenCountError),
    4: ("global_tokens is negative", SPMDTokenCountError),
    5: ("tensor on a device the backend cannot use", SPMDDeviceError),
    6: ("unknown placement", SPMDLayoutError),
}


def _signature(local: torch.Tensor, dim: int) -> int:
    rest = tuple(s for i, s in enumerate(local.shape) if i != dim)
    return zlib.crc32(f"{local.dtype}|{rest}".encode())


def _local_row(local: Any, axis: MeshAxis, placement: Any, total: Any, token_dim: int, strict: bool) -> tuple[list[int], str]:
    """This rank's table row and, if it has a local problem, its message."""
    row = [0, _NO_T, -1, _KINDS.get(type(placement), -1), token_dim, 0, int(strict), 0]
    if not isinstance(local, torch.Tensor):
        row[0] = 1
        return row, f"rank {axis.rank}: expected a torch.Tensor as local, found {type(local).__name__}"
    try:
        dim = _check_token_dim(local, placement, token_dim, axis)
    except SPMDLayoutError as e:
        row[0] = 6 if row[3] < 0 else 2
        return row, str(e)
    row[2], row[4], row[5] = local.shape[dim], dim, _signature(local, dim)
    if total is not None:
        try:
            row[1] = _check_total(total, axis)
        except SPMDTokenCountError as e:
            negative = not isinstance(total, bool) and hasattr(total, "__index__")
            row[0], row[7] = (4, total.__index__()) if negative else (3, 0)
            return row, str(e)
    if (problem := axis.device_problem(local)) is not None:
        row[0] = 5
        return row, f"rank {axis.rank}: {problem}"
    return row, ""


def from_local(
    local: torch.Tensor,
    mesh: MeshLike,
    *,
    placement: Placement = Shard(0),
    global_tokens: Optional[int] = None,
    strict: bool = False,
    token_dim: int = 0,
) -> SPMDTensor:
    """Wrap an already-local tensor, verifying the layout across ranks.

    One all-gather of eight int64 per rank (declared T, rows, placement, token
    dim, a dtype/feature-shape signature, strict, local problems), then one
    host transfer of that table: every rank evaluates the same verdict, so a
    bad input raises on every rank. Caught: rows that break the chunk rule for
    the declared T (also a split that is plausible on each rank but jointly
    wrong, like 1,2,3,4 rows for T=10), T, placement, token dim, dtype,
    feature shape or ``strict`` differing between ranks, bad T values, tensors
    on the wrong device, and ``strict`` with ``T % n != 0``.

    Without ``global_tokens``, ``T`` is the sum of the exchanged rows for
    ``Shard`` (the rows for ``Replicate``/``Partial``) — never local × world.
    With checking off (:func:`spmdmoe.set_checks`), nothing is exchanged: the
    declared T is trusted (and required), and only this rank's rows are checked.

    ``token_dim`` is the token dimension for non-``Shard`` placements.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.from_local(torch.zeros(7, 4), pg).global_tokens
    7
    """
    axis = mesh_axis(mesh)
    if not checks_enabled():
        if global_tokens is None and not isinstance(placement, Varying):
            raise SPMDLayoutError(
                f"rank {axis.rank}: with checking off, from_local does no communication and needs "
                "global_tokens=T (it never infers T from local shapes); pass it, or turn checks on"
            )
        out = SPMDTensor(local, axis, placement, global_tokens=global_tokens, token_dim=token_dim)
        if strict and (problem := _strict_problem(out.global_tokens, axis)) is not None:
            raise SPMDLayoutError(problem)
        return out

    row, message = _local_row(local, axis, placement, global_tokens, token_dim, strict)
    mine = torch.tensor(row, dtype=torch.int64, device=axis.metadata_device())
    table_t = torch.empty(axis.size * len(row), dtype=torch.int64, device=mine.device)
    all_gather_single(table_t, mine, group=axis.group)
    flat = table_t.tolist()  # the one host transfer
    table = [flat[i * len(row) : (i + 1) * len(row)] for i in range(axis.size)]
    error, text = _verdict(table, axis, placement, message)
    if error is not None:
        raise error(text)
    dim, rows_all = row[4], [r[2] for r in table]
    if isinstance(placement, Varying):
        return SPMDTensor._new(local, axis, placement, None, dim)
    total = row[1] if row[1] != _NO_T else (sum(rows_all) if isinstance(placement, Shard) else row[2])
    return SPMDTensor._new(local, axis, placement if not isinstance(placement, Shard) else Shard(dim), total, dim)


def _verdict(table: list[list[int]], axis: MeshAxis, placement: Placement, message: str) -> tuple[Any, str]:
    """The same (error type, message) on every rank, or (None, "")."""
    n = axis.size
    local_bad = [(r, t[0]) for r, t in enumerate(table) if t[0]]
    if local_bad:
        # Most specific type first: a device problem outranks a count problem, etc.
        kinds = {code for _, code in local_bad}
        error = next(_LOCAL[c][1] for c in (5, 3, 4, 1, 2, 6) if c in kinds)
        parts = [f"rank {r}: {_LOCAL[c][0]}" + (f" ({table[r][7]})" if c == 4 else "") for r, c in local_bad]
        own = f"\n  this rank's detail: {message}" if message else ""
        return error, f"from_local rejected the layout on {len(local_bad)} of {n} ranks: " + "; ".join(parts) + own
    for field, what in ((3, "placement"), (4, "token dim"), (6, "strict"), (1, "declared global_tokens")):
        values = [t[field] for t in table]
        if len(set(values)) > 1:
            shown = [("None" if v == _NO_T else v) if field == 1 else v for v in values]
            if field == 3:
                names = {v: k.__name__ for k, v in _KINDS.items()}
                shown = [names[v] for v in values]
            return SPMDLayoutError, (
                f"rank {axis.rank}: ranks disagree on the {what}: per rank {shown}; every rank must "
                f"pass the same {what} to from_local"
            )
    signatures = [t[5] for t in table]
    if len(set(signatures)) > 1:
        groups: dict[int, list[int]] = {}
        for r, s in enumerate(signatures):
            groups.setdefault(s, []).append(r)
        return SPMDLayoutError, (
            f"rank {axis.rank}: ranks disagree on dtype or non-token dims: rank groups "
            f"{sorted(groups.values())}; every rank's shard needs the same dtype and feature shape"
        )
    if isinstance(placement, Varying):
        return None, ""
    rows = [t[2] for t in table]
    declared = table[0][1]
    is_shard = isinstance(placement, Shard)
    total = declared if declared != _NO_T else (sum(rows) if is_shard else rows[0])
    expected = layout.chunk_counts(total, n) if is_shard else [total] * n
    if rows != expected:
        bad = [r for r in range(n) if rows[r] != expected[r]]
        dim = table[0][4]
        own = _bad_rows_message(placement, total, axis, rows[axis.rank], dim) if axis.rank in bad else ""
        origin = "declared" if declared != _NO_T else "inferred as the sum of rows"
        return SPMDLayoutError, (
            f"bad {placement} split on ranks {bad} for global_tokens={total} ({origin}) on {n} ranks: "
            f"expected rows {expected if n <= 16 else '(chunk rule)'}, found {rows if n <= 16 else [rows[r] for r in bad]}"
            + (f"\n  {own}" if own else f"\n  fix: shard with spmdmoe.shard(x, mesh) or give each rank its chunk-rule rows")
        )
    if table[0][6] and (problem := _strict_problem(total, axis)) is not None:
        return SPMDLayoutError, problem
    return None, ""
