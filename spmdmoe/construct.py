"""Building ``SPMDTensor``s: ``shard``, ``from_local`` and ``padded_empty``.

``from_local`` verifies a layout across ranks with ONE check exchange (an ``all_to_all_single`` of
``spmdmoe.agreement``): each rank sends a few int64 describing what it holds, every rank evaluates the same rules on the
same table, so a bad input makes every rank raise the same error together (not one while the others wait).
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import torch

from .agreement import Field, Problem, agree, dtype_code, dtype_name
from .types import layout
from .types.errors import SPMDLayoutError
from .types.mesh import MeshAxis, MeshLike, mesh_axis
from .types.placement import Partial, Placement, Replicate, Shard, Varying
from .types.tensor import (SPMDTensor, _bad_rows_message, _buffer_rows, _check_token_dim, _check_total, count_message,
                           parse_count, rejecting)

__all__ = ["shard", "from_local", "padded_empty"]


def _check_strict(total: int, axis: MeshAxis) -> None:
    if total % axis.size:
        raise SPMDLayoutError(
            f"rank {axis.rank}: strict=True needs global_tokens divisible by the axis size: found "
            f"global_tokens={total} on {axis.size} ranks ({total} % {axis.size} = {total % axis.size}); "
            f"pad the batch to {layout.padded_global_tokens(total, axis.size)} tokens or drop strict=True")


def shard(x: torch.Tensor, mesh: MeshLike, *, dim: int = 0, strict: bool = False) -> SPMDTensor:
    """This rank's chunk of ``x`` along ``dim`` under the chunk rule. No communication.

    ``x`` is the full tensor, identical on every rank. The result's ``local`` is a view of ``x`` (autograd flows back to
    ``x``); with ``T = x.shape[dim]`` on ``n`` ranks, rank ``r`` holds rows ``[min(r*p, T), min((r+1)*p, T))`` with
    ``p = ceil(T/n)``: T=5 on 4 ranks gives 2, 2, 1, 0 rows.

    Raises ``SPMDMeshError`` (mesh not 1-D), ``SPMDLayoutError`` (``dim`` out of range; ``strict`` and ``T % n != 0``),
    ``SPMDDeviceError`` (``x`` on a device the backend cannot use). Every rank sees the same ``x``, so all raise.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.shard(torch.arange(10.).view(5, 2), pg).local_tokens
    5
    """
    axis = mesh_axis(mesh)
    with rejecting("shard", axis):  # collective-checking mode: the axis' next collective check raises it everywhere
        d = _check_token_dim(x, Shard(dim), 0, axis)
        axis.check_device(x, "shard(x)")
        total = x.shape[d]
        if strict:
            _check_strict(total, axis)
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

    Write the valid rows through ``.local`` (a view); a collective then sends ``.buffer`` without a padding copy. The
    token dimension is 0; ``row_shape`` is the shape of one row. Spare rows are ``empty``: never read.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> y = spmdmoe.padded_empty(pg, spmdmoe.Partial(), 3, (4,))
    >>> y.local.shape, y.buffer.shape
    (torch.Size([3, 4]), torch.Size([3, 4]))
    """
    axis = mesh_axis(mesh)
    with rejecting("padded_empty", axis):
        total = _check_total(global_tokens, axis)
        if isinstance(placement, Varying):
            raise SPMDLayoutError("Varying tensors have no padded layout: allocate them with torch.empty")
    rows = _buffer_rows(placement, total, axis)
    buf = torch.empty((rows, *row_shape), dtype=dtype, device=device)
    return SPMDTensor.from_buffer(buf, axis, placement, global_tokens=total)


# ---------------------------------------------------------------- from_local
_NO_T = -1
_KINDS = {Shard: 0, Replicate: 1, Partial: 2, Varying: 3}
_KIND_NAMES = {v: k.__name__ for k, v in _KINDS.items()}
# The fields every rank must agree on, in the order they are compared.
_PLACEMENT = Field("placement", show=lambda v: _KIND_NAMES.get(v, "unknown"), fix="every rank must pass the same placement to from_local")
_TOKEN_DIM = Field("token dim")
_STRICT = Field("strict", show=lambda v: str(bool(v)))
_DECLARED = Field("declared global_tokens", show=lambda v: "None" if v == _NO_T else str(v),
                  fix="every rank must declare the same global_tokens (or none)")
_DTYPE = Field("dtype", show=dtype_name, fix="every rank's shard needs the same dtype")
_FEATURES = Field("non-token dims", show=lambda v: f"[{v}]" if v >= 0 else f"shape#{-v % 9973}",  # one dim or a hash
                  fix="every rank's shard needs the same feature shape (dtype and non-token dims)")


def _local_findings(local: Any, axis: MeshAxis, placement: Any, total: Any, token_dim: int) -> tuple[Problem, list[int]]:
    """This rank's findings and its row of field values ``[kind, dim, declared, dtype, features, rows]``."""
    found = Problem()
    kind = _KINDS.get(type(placement), -1)
    values = [kind, token_dim, _NO_T, 0, 0, -1]
    if not isinstance(local, torch.Tensor):
        found.add("not_tensor", f"rank {axis.rank}: expected a torch.Tensor as local, found {type(local).__name__}")
        return found, values
    try:
        dim = _check_token_dim(local, placement, token_dim, axis)
        rest = tuple(s for i, s in enumerate(local.shape) if i != dim)
        features = rest[0] if len(rest) == 1 else -1 - zlib.crc32(repr(rest).encode())  # a (T, D) shard: D itself
        values[1:] = [dim, _NO_T, dtype_code(local.dtype), features, local.shape[dim]]
    except SPMDLayoutError as e:
        found.add("placement" if kind < 0 else "token_dim", str(e))
    if total is not None:
        value, problem = parse_count(total)
        if problem:
            found.add(problem, count_message(total, problem, axis.rank))
        else:
            values[2] = value
    if (problem := axis.device_problem(local)) is not None:
        found.add("device", f"rank {axis.rank}: {problem}")
    return found, values


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

    One agreement exchange (``spmdmoe.agreement.agree``: a check exchange of a few int64 per rank and one host transfer
    of them): every rank evaluates the same verdict, so a bad input raises on every rank. Caught: rows that break the
    chunk rule for the declared T (also a split that is plausible on each rank but jointly wrong, like 1,2,3,4 rows for
    T=10), T, placement, token dim, dtype, feature shape or ``strict`` differing between ranks, bad T values (not an
    int, negative, past int64), tensors on the wrong device, and ``strict`` with ``T % n != 0``.

    Without ``global_tokens``, ``T`` is the sum of the exchanged rows for ``Shard`` (the rows for
    ``Replicate``/``Partial``) — never local × world. The exchange and the verdict are the same in every checking mode
    (:func:`spmdmoe.set_checks`): whether a collective runs never depends on a rank-local setting. To wrap rows with no
    communication, use ``SPMDTensor(local, mesh, placement, global_tokens=T)`` (it checks this rank's rows only).
    ``token_dim``: the token dimension of non-``Shard`` placements.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.from_local(torch.zeros(7, 4), pg).global_tokens
    7
    """
    return _from_local(local, mesh, placement, global_tokens, strict, token_dim)


def _from_local(local: Any, mesh: MeshLike, placement: Any, global_tokens: Any, strict: bool, token_dim: int,
                problem: Optional[tuple[str, str]] = None) -> SPMDTensor:
    """:func:`from_local`; ``problem``: ``(kind, detail)`` a caller found on this rank before (``from_dtensor``),
    added to this rank's findings so that it is raised on every rank in the same exchange."""
    axis = mesh_axis(mesh)
    found, (kind, dim, declared, dtype, features, rows) = _local_findings(local, axis, placement, global_tokens, token_dim)
    if problem is not None:
        found.add(*problem)
    table = agree(
        "from_local", axis, found,
        [(_PLACEMENT, kind), (_TOKEN_DIM, dim), (_STRICT, int(bool(strict))), (_DECLARED, declared),
         (_DTYPE, dtype), (_FEATURES, features)],
        extra=[rows],
    )
    if isinstance(placement, Varying):
        return SPMDTensor._new(local, axis, placement, None, dim)
    rows_all = [row[-1] for row in table]
    is_shard = isinstance(placement, Shard)
    total = declared if declared != _NO_T else (sum(rows_all) if is_shard else rows_all[0])
    _check_rows(rows_all, total, declared != _NO_T, axis, placement, dim)
    if strict:
        _check_strict(total, axis)
    return SPMDTensor._new(local, axis, Shard(dim) if is_shard else placement, total, dim)


def _check_rows(rows: list[int], total: int, declared: bool, axis: MeshAxis, placement: Placement, dim: int) -> None:
    """Raise the same error on every rank unless ``rows`` follow the layout for ``total`` (from the table)."""
    n = axis.size
    expected = layout.chunk_counts(total, n) if isinstance(placement, Shard) else [total] * n
    if rows == expected:
        return
    bad = [r for r in range(n) if rows[r] != expected[r]]
    own = _bad_rows_message(placement, total, axis, rows[axis.rank], dim) if axis.rank in bad else ""
    origin = "declared" if declared else "inferred as the sum of rows"
    raise SPMDLayoutError(
        f"bad {placement} split on ranks {bad} for global_tokens={total} ({origin}) on {n} ranks: "
        f"expected rows {expected if n <= 16 else '(chunk rule)'}, found {rows if n <= 16 else [rows[r] for r in bad]}"
        + (f"\n  {own}" if own else "\n  fix: shard with spmdmoe.shard(x, mesh) or give each rank its chunk-rule rows")
    )
