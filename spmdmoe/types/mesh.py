"""One mesh axis: the process group a placement lives on.

Every public function that takes ``mesh`` accepts

* a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (``mesh2d["sp"]`` is a
  named dim of a larger mesh, and is 1-D),
* a ``(DeviceMesh, "name")`` pair, meaning ``mesh[name]``,
* a ``torch.distributed.ProcessGroup``,
* or a :class:`MeshAxis` already built from one of those.

:func:`mesh_axis` normalises them once (the result is cached per object) to a
:class:`MeshAxis`: the group, this rank's index in it, its size, and the device
types its backend can communicate. Two axes are equal when they use the same
process group, whatever object they were built from.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .errors import SPMDDeviceError, SPMDMeshError

__all__ = ["MeshAxis", "MeshLike", "mesh_axis", "init_mesh"]

_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "xccl": ("xpu",),
                    "fake": ("cpu", "cuda", "meta")}  # torch's fake group (planning): meta tensors too


class MeshAxis:
    """A normalised mesh axis. Immutable; compares by process group identity.

    Attributes: ``group`` (the ``ProcessGroup``), ``rank`` (this process' index
    in the group), ``size``, ``device_type`` (where small metadata tensors for
    this axis live: ``"cuda"`` for NCCL, else ``"cpu"``), ``devices`` (device
    types the backend accepts), ``source`` (the object it was built from),
    ``ranks`` (the global rank of each member, in axis-rank order).
    """

    __slots__ = ("group", "rank", "size", "device_type", "devices", "source", "ranks", "__weakref__")

    group: dist.ProcessGroup
    rank: int
    size: int
    device_type: str
    devices: tuple[str, ...]
    source: Any
    ranks: tuple[int, ...]

    def __init__(self, group: dist.ProcessGroup, device_type: str | None = None, source: Any = None):
        backend = str(dist.get_backend(group))
        devices: list[str] = []
        for part in backend.split(","):
            name = part.split(":")[-1]
            for dev in _BACKEND_DEVICES.get(name, ("cpu", "cuda")):
                if dev not in devices:
                    devices.append(dev)
        if device_type is None:
            device_type = "cuda" if "cuda" in devices and torch.cuda.is_available() else devices[0]
        setattr_ = object.__setattr__
        setattr_(self, "group", group)
        setattr_(self, "rank", group.rank())
        setattr_(self, "size", group.size())
        setattr_(self, "device_type", device_type)
        setattr_(self, "devices", tuple(devices))
        setattr_(self, "source", group if source is None else source)
        setattr_(self, "ranks", tuple(dist.get_process_group_ranks(group)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MeshAxis is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshAxis) and other.group is self.group

    def __hash__(self) -> int:
        return id(self.group)

    def __repr__(self) -> str:
        return f"MeshAxis(rank={self.rank}, size={self.size}, backend={dist.get_backend(self.group)})"

    def device_mesh(self) -> DeviceMesh:
        """This axis as a 1-D ``DeviceMesh`` (the one given, or one built on its group; cached)."""
        mesh = _built_meshes.get(self.group)
        if mesh is None:
            src = self.source
            if isinstance(src, tuple):
                mesh = src[0][src[1]]
            elif isinstance(src, DeviceMesh):
                mesh = src
            else:
                mesh = DeviceMesh.from_group(self.group, self.device_type)
            _built_meshes[self.group] = mesh
        return mesh

    def metadata_device(self) -> torch.device:
        """The device for this axis' small metadata exchanges."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def __copy__(self) -> "MeshAxis":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "MeshAxis":
        """Itself: an axis names a process group, which a copied module shares (groups cannot be copied)."""
        return self

    def device_problem(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` cannot be communicated on this axis, or ``None``."""
        dev = tensor.device
        if dev.type not in self.devices:
            return (
                f"tensor is on {dev}, but the axis' backend ({dist.get_backend(self.group)}) "
                f"communicates {'/'.join(self.devices)} tensors; move it with .to(...)"
            )
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            return (
                f"tensor is on {dev}, but this rank's current CUDA device is "
                f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device(local_rank) "
                "and create tensors there"
            )
        return None

    def check_device(self, tensor: torch.Tensor, what: str = "tensor") -> None:
        """Raise :class:`SPMDDeviceError` if ``tensor`` cannot be sent on this axis."""
        problem = self.device_problem(tensor)
        if problem is not None:
            raise SPMDDeviceError(f"rank {self.rank}: {what}: {problem}")


MeshLike = Union[DeviceMesh, "tuple[DeviceMesh, str]", dist.ProcessGroup, MeshAxis]

# Keyed by (process group, device type): a MeshAxis depends on nothing else. Not by the mesh
# object: DeviceMeshes with the same ranks and names compare equal even when they hold different
# groups (two init_mesh calls), and mesh2d["sp"] builds a new object on every indexing, so an
# identity key would grow without bound. Bounded by the number of process groups.
_cache: dict[tuple[Any, Any], MeshAxis] = {}
_built_meshes: "weakref.WeakKeyDictionary[Any, DeviceMesh]" = weakref.WeakKeyDictionary()


def _check_1d(mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        names = getattr(mesh, "mesh_dim_names", None)
        hint = f"pick one axis, e.g. mesh[{names[0]!r}]" if names else "build a 1-D mesh or pass a named dim"
        raise SPMDMeshError(
            f"rank {dist.get_rank()}: expected a 1-D mesh (one axis), found a {mesh.ndim}-D mesh "
            f"of shape {tuple(mesh.shape)} (dims {names}); {hint}"
        )


def mesh_axis(mesh: MeshLike) -> MeshAxis:
    """Normalise ``mesh`` to a :class:`MeshAxis` (cached per process group and device type)."""
    if isinstance(mesh, MeshAxis):
        return mesh
    if isinstance(mesh, DeviceMesh):
        _check_1d(mesh)
        key: tuple[Any, Any] = (mesh.get_group(), mesh.device_type)
    elif isinstance(mesh, tuple) and len(mesh) == 2 and isinstance(mesh[0], DeviceMesh):
        try:
            key = (mesh[0].get_group(mesh[1]), mesh[0].device_type)
        except (KeyError, ValueError, RuntimeError) as e:
            raise SPMDMeshError(
                f"rank {dist.get_rank()}: the mesh has no dim {mesh[1]!r}: expected one of "
                f"{mesh[0].mesh_dim_names}, found {mesh[1]!r}; pass (mesh, name) with a name from that list"
            ) from e
    elif isinstance(mesh, dist.ProcessGroup):
        key = (mesh, None)
    else:
        raise SPMDMeshError(
            f"expected a 1-D DeviceMesh, a (DeviceMesh, dim_name) pair, a ProcessGroup or a "
            f"MeshAxis as mesh, found {type(mesh).__name__}"
        )
    axis = _cache.get(key)
    if axis is None:
        axis = _cache[key] = MeshAxis(key[0], key[1], mesh)
    return axis


def init_mesh(device_type: str, shape: "tuple[int, ...]", *, mesh_dim_names: "tuple[str, ...]",
              timeout: "timedelta | None" = None) -> DeviceMesh:
    """``init_device_mesh`` with the process groups created explicitly, one per row of each dim.

    Same mesh (ranks laid out row-major), same named dims, every group made
    by ``new_group`` in the same order on every rank (every rank must call
    it). It does not prevent gloo's abort at interpreter exit ("terminate
    called without an active exception": 8 of 15 four-process runs of a
    1-D ``init_mesh`` script on torch 2.13 that ended with
    ``destroy_process_group()``); end jobs with :func:`spmdmoe.shutdown`.

    ``timeout``: every group of the mesh is a new group with this timeout
    (without it, a dim over every rank uses the default group and the others
    the default timeout), e.g. to let one part of a job fail fast.

    Every rank first exchanges its ``shape`` and ``mesh_dim_names`` (one all-gather of 10 integers per
    rank): a rank that passes other ones makes every rank raise the same :class:`SPMDMeshError`, naming
    the values per rank, instead of leaving its peers waiting in ``new_group``.

    >>> import spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.init_mesh("cpu", (1, 1), mesh_dim_names=("dp", "sp"))["sp"].size()
    1
    """
    world, me = dist.get_world_size(), dist.get_rank()
    _agree_on_mesh(tuple(shape), tuple(mesh_dim_names))
    numel = 1
    for size in shape:
        numel *= size
    if numel != world or len(mesh_dim_names) != len(shape):
        raise SPMDMeshError(
            f"rank {me}: a mesh of shape {tuple(shape)} ({len(mesh_dim_names)} names) needs "
            f"{numel} processes and one name per dim, found {world} processes"
        )
    grid = torch.arange(world).view(*shape)
    groups = []
    for dim in range(grid.dim()):
        rows = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
        mine = None
        for row in rows.tolist():  # every rank creates every group, in the same order
            new = len(row) < world or timeout is not None
            group = dist.new_group(row, timeout=timeout) if new else dist.group.WORLD
            if me in row:
                mine = group
        groups.append(mine)
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], device_type, mesh=grid,
                                 mesh_dim_names=tuple(mesh_dim_names))


_MAX_DIMS = 8


def _agree_on_mesh(shape: "tuple[int, ...]", names: "tuple[str, ...]") -> None:
    """Raise the same :class:`SPMDMeshError` on every rank when ranks pass different meshes to :func:`init_mesh`
    (one all-gather over the world: dims, each size, a checksum of the names)."""
    import zlib

    from ..agreement import Field, Found, agree  # here: spmdmoe.agreement imports this package

    fix = "every rank must call init_mesh with the same shape and mesh_dim_names, in the same order"
    sizes = [int(s) for s in shape[:_MAX_DIMS]] + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    fields = [(Field("number of mesh dims", SPMDMeshError, fix=fix), len(shape))]
    fields += [(Field(f"size of mesh dim {i}", SPMDMeshError, fix=fix), v) for i, v in enumerate(sizes)]
    checksum = zlib.crc32("\0".join(names).encode())
    fields.append((Field("mesh_dim_names", SPMDMeshError, lambda v: f"names checksum {v:#010x}",
                         fix=f"{fix} (this rank: {names})"), checksum))
    agree("init_mesh", None, Found(), fields, global_ranks=True)
