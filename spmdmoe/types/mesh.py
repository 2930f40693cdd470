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
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .errors import SPMDDeviceError, SPMDMeshError

__all__ = ["MeshAxis", "MeshLike", "mesh_axis"]

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
        for name, value in zip(self.__slots__, (group, group.rank(), group.size(), device_type, tuple(devices),
                                                group if source is None else source,
                                                tuple(dist.get_process_group_ranks(group)))):
            object.__setattr__(self, name, value)

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

    def __copy__(self, memo: Any = None) -> "MeshAxis":
        """Itself: an axis names a process group, which a copied module shares (groups cannot be copied)."""
        return self

    __deepcopy__ = __copy__

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
