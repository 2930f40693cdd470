"""The vocabulary of spmdmoe: placements, mesh axes, ``SPMDTensor``, errors, checks."""

from .checks import Layout, assert_layout, checks, checks_enabled, checks_mode, layout_checked, set_checks
from .construct import from_local, padded_empty, shard
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
from .mesh import MeshAxis, MeshLike, init_mesh, mesh_axis
from .product import product_axis
from .placement import Partial, Placement, Replicate, Shard, Varying
from .routed import RoutedTokens
from .tensor import SPMDTensor

__all__ = [
    "Layout",
    "MoEConfigError",
    "RoutedTokens",
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
    "from_local",
    "init_mesh",
    "layout_checked",
    "local_tokens",
    "mesh_axis",
    "padded_empty",
    "padded_global_tokens",
    "padded_local_tokens",
    "product_axis",
    "set_checks",
    "shard",
]
