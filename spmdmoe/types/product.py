"""One axis spanning several orthogonal axes: the flattened product of, e.g., ``dp`` and ``ep``.

Data-parallel wrappers reduce a gradient over one process group; when the
ranks that hold different batches of a replicated parameter lie on two axes
(``dp`` x ``ep`` in an EP plan) that group is their product. DeviceMesh offers
this as ``mesh["dp", "ep"]._flatten()`` (private, and only for dims of one
mesh); :func:`product_axis` builds it from any axes, including ProcessGroups.
"""

from __future__ import annotations

import math
from typing import Optional

import torch.distributed as dist

from ..agreement import exchange_rows
from .errors import SPMDMeshError
from .mesh import MeshAxis, MeshLike, mesh_axis

__all__ = ["product_axis"]

_products: dict[tuple[dist.ProcessGroup, ...], MeshAxis] = {}


def product_axis(*axes: Optional[MeshLike]) -> Optional[MeshAxis]:
    """The axis whose group is the product of ``axes`` (``None`` entries and 1-rank axes skipped).

    Returns ``None`` when nothing is left, the axis itself when one is left.
    Otherwise a collective over the whole world the first time (one all-gather
    of every rank's group members, then one ``new_group`` per product block,
    created by every rank in the same order); cached per tuple of groups, so
    every rank must make the same sequence of first calls. Raises
    ``SPMDMeshError`` on every rank if the axes are not orthogonal (a block's
    size is not the product of the axis sizes).

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
    rows = exchange_rows(None, row)
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
    mine = None
    for block in sorted(blocks.values()):
        group = dist.group.WORLD if len(block) == world else dist.new_group(block)
        if me in block:
            mine = group
    assert mine is not None
    return MeshAxis(mine, parts[0].device_type)
