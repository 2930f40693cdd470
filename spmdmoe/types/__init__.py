"""The vocabulary of spmdmoe: placements, mesh axes, ``SPMDTensor``, errors, checks.

Nothing here talks to other ranks (no import of ``spmdmoe.agreement``): what builds tensors and meshes
across ranks is ``spmdmoe.construct`` and ``spmdmoe.meshes``.
"""

from .checks import Layout, assert_layout, checks, checks_enabled, checks_mode, layout_checked, set_checks
from .errors import (
    MoEConfigError,
    SPMDCapacityError,
    SPMDCollectiveError,
    SPMDDeviceError,
    SPMDDtypeError,
    SPMDLayoutError,
    SPMDMeshError,
    SPMDRoutingError,
    SPMDShapeError,
    SPMDTokenCountError,
)
from .layout import chunk_counts, chunk_offset, local_tokens, padded_global_tokens, padded_local_tokens
from .mesh import MeshAxis, MeshLike, mesh_axis
from .placement import Partial, Placement, Replicate, Shard, Varying
from .tensor import SPMDTensor

__all__ = [
    "Layout",
    "MoEConfigError",
    "SPMDCapacityError",
    "SPMDCollectiveError",
    "SPMDRoutingError",
    "SPMDShapeError",
    "MeshAxis",
    "MeshLike",
    "Partial",
    "Placement",
    "Replicate",
    "SPMDDeviceError",
    "SPMDDtypeError",
    "SPMDLayoutError",
    "SPMDMeshError",
    "SPMDTensor",
    "SPMDTokenCountError",
    "Shard",
    "Varying",
    "assert_layout",
    "checks",
    "checks_enabled",
    "checks_mode",
    "chunk_counts",
    "chunk_offset",
    "layout_checked",
    "local_tokens",
    "mesh_axis",
    "padded_global_tokens",
    "padded_local_tokens",
    "set_checks",
]
