"""Building meshes and axes, agreed across ranks: :func:`init_mesh` (an N-D ``DeviceMesh`` on explicitly
created groups) and :func:`product_axis` (one axis spanning several orthogonal axes).

A mesh's vocabulary (``MeshAxis``, ``mesh_axis``) is ``spmdmoe.types.mesh``; what is built here talks to
the other ranks first (``spmdmoe.agreement``), so that a rank passing other arguments makes every rank
raise the same error instead of leaving its peers waiting in ``new_group``.

``product_axis``: data-parallel wrappers reduce a gradient over one process group; when the ranks that hold different
batches of a replicated parameter lie on two axes (``dp`` x ``ep`` in an EP plan) that group is their product.
DeviceMesh offers this as ``mesh["dp", "ep"]._flatten()`` (private, and only for dims of one mesh); :func:`product_axis`
builds it from any axes, including ProcessGroups.
"""

from __future__ import annotations

import math
import zlib
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .agreement import Field, Problem, agree, exchange_rows
from .types.errors import SPMDMeshError
from .types.mesh import MeshAxis, MeshLike, mesh_axis

__all__ = ["init_mesh", "product_axis", "own_axis"]

_products: dict[tuple[dist.ProcessGroup, ...], MeshAxis] = {}
_own: dict[tuple[str, object], MeshAxis] = {}


def own_axis(device_type: str) -> MeshAxis:
    """This rank alone, as an axis of one rank on ``device_type`` (e.g. FSDP2's mesh for parameters no other rank
    holds a replica of: torchtitan's experts when EP spans the data-parallel ranks). A collective over the whole
    world the first time (every rank creates every rank's 1-rank group, in rank order); cached per device type.

    >>> import spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.meshes.own_axis("cpu").size
    1
    """
    key = (device_type, dist.group.WORLD)
    if key not in _own:
        _own[key] = MeshAxis(_mine([[r] for r in range(dist.get_world_size())], dist.new_group), device_type)
    return _own[key]


def _mine(blocks: list[list[int]], make: Callable[[list[int]], Any]) -> Any:
    """``make(block)`` for every block of global ranks, by every rank in the same order; this rank's group."""
    groups = [(make(block), block) for block in blocks]
    return next(group for group, block in groups if dist.get_rank() in block)


def product_axis(*axes: Optional[MeshLike]) -> Optional[MeshAxis]:
    """The axis whose group is the product of ``axes`` (``None`` entries and 1-rank axes skipped).

    Returns ``None`` when nothing is left, the axis itself when one is left.
    Otherwise a collective over the whole world the first time (one check exchange of every rank's group members, then
    one ``new_group`` per product block, created by every rank in the same order); cached per tuple of groups, so every
    rank must make the same sequence of first calls. Raises ``SPMDMeshError`` on every rank if the axes are not
    orthogonal (a block's size is not the product of the axis sizes).

    >>> import spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> print(product_axis(pg, None))  # a 1-rank axis and None: nothing left
    None
    """
    parts: list[MeshAxis] = []
    for a in axes:
        axis = None if a is None else mesh_axis(a)
        if axis is not None and axis.size > 1 and axis not in parts:
            parts.append(axis)
    if len(parts) <= 1:
        return parts[0] if parts else None
    key = tuple(a.group for a in parts)
    if key not in _products:
        _products[key] = _build(parts)
    return _products[key]


def _build(parts: list[MeshAxis]) -> MeshAxis:
    me, world = dist.get_rank(), dist.get_world_size()
    row = [r for a in parts for r in sorted(dist.get_process_group_ranks(a.group))]
    # every rank's groups, as a table every rank holds the same copy of (the agreement exchange)
    rows = exchange_rows(None, row, "mesh grid")
    parent = list(range(world))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for members in rows:  # each rank joins the members of each of its groups
        for r in members[1:]:
            parent[find(r)] = find(members[0])
    blocks: dict[int, list[int]] = {}
    for r in range(world):
        blocks.setdefault(find(r), []).append(r)
    want = math.prod(a.size for a in parts)
    sizes = sorted({len(b) for b in blocks.values()})
    if sizes != [want]:
        raise SPMDMeshError(
            f"rank {me}: axes of sizes {[a.size for a in parts]} are not orthogonal: their products have "
            f"{sizes} ranks, expected {want}; pass axes of one mesh (e.g. mesh['dp'] and mesh['ep'])"
        )
    make = lambda block: dist.group.WORLD if len(block) == world else dist.new_group(block)  # noqa: E731
    return MeshAxis(_mine(sorted(blocks.values()), make), parts[0].device_type)


def init_mesh(device_type: str, shape: "tuple[int, ...]", *, mesh_dim_names: "tuple[str, ...]",
              timeout: "timedelta | None" = None) -> DeviceMesh:
    """``init_device_mesh`` with the process groups created explicitly, one per row of each dim.

    Same mesh (ranks laid out row-major), same named dims, every group made by ``new_group`` in the same order on every
    rank (every rank must call it). It does not prevent gloo's abort at interpreter exit ("terminate called without an
    active exception": 8 of 15 four-process runs of a 1-D ``init_mesh`` script on torch 2.13 that ended with
    ``destroy_process_group()``); end jobs with :func:`spmdmoe.shutdown`.

    ``timeout``: every group of the mesh is a new group with this timeout (without it, a dim over every rank uses the
    default group and the others the default timeout), e.g. to let one part of a job fail fast.

    Every rank first exchanges its ``shape`` and ``mesh_dim_names`` (one check exchange of 10 integers per
    rank): a rank that passes other ones makes every rank raise the same :class:`SPMDMeshError`, naming
    the values per rank, instead of leaving its peers waiting in ``new_group``.

    >>> import spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.init_mesh("cpu", (1, 1), mesh_dim_names=("dp", "sp"))["sp"].size()
    1
    """
    world, me = dist.get_world_size(), dist.get_rank()
    _agree_on_mesh(tuple(shape), tuple(mesh_dim_names))
    numel = math.prod(shape)
    if numel != world or len(mesh_dim_names) != len(shape):
        raise SPMDMeshError(
            f"rank {me}: a mesh of shape {tuple(shape)} ({len(mesh_dim_names)} names) needs "
            f"{numel} processes and one name per dim, found {world} processes"
        )
    grid = torch.arange(world).view(*shape)
    groups = []
    for dim in range(grid.dim()):
        rows = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
        groups.append(_mine(rows.tolist(), lambda row: dist.new_group(row, timeout=timeout)
                            if len(row) < world or timeout is not None else dist.group.WORLD))
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], device_type, mesh=grid,
                                 mesh_dim_names=tuple(mesh_dim_names))


_MAX_DIMS = 8


def _agree_on_mesh(shape: "tuple[int, ...]", names: "tuple[str, ...]") -> None:
    """Raise the same :class:`SPMDMeshError` on every rank when ranks pass different meshes to :func:`init_mesh`
    (one check exchange over the world: dims, each size, a checksum of the names)."""
    fix = "every rank must call init_mesh with the same shape and mesh_dim_names, in the same order"
    sizes = [int(s) for s in shape[:_MAX_DIMS]] + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    fields = [(Field("number of mesh dims", SPMDMeshError, fix=fix), len(shape))]
    fields += [(Field(f"size of mesh dim {i}", SPMDMeshError, fix=fix), v) for i, v in enumerate(sizes)]
    checksum = zlib.crc32("\0".join(names).encode())
    fields.append((Field("mesh_dim_names", SPMDMeshError, lambda v: f"names checksum {v:#010x}",
                         fix=f"{fix} (this rank: {names})"), checksum))
    agree("init_mesh", None, Problem(), fields, global_ranks=True)
