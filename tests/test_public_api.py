"""The top-level namespace is the public API: exactly these names, each one importable from ``spmdmoe``.

Moving a definition between rooms (docs/design.md §0) must not drop it from here: ``RoutedTokens`` once went
missing when it moved from ``spmdmoe.types`` to ``spmdmoe.moe.transports.routed``. A name added on purpose is added below.
"""

import importlib

import spmdmoe

PUBLIC = {
    # submodules
    "agreement", "collectives", "dtensor", "moe", "testing", "types",
    # collectives and construction across ranks
    "all_gather", "all_reduce", "all_to_all", "exchange_counts", "redistribute", "reduce_scatter",
    "from_local", "padded_empty", "shard", "init_mesh", "product_axis", "check_errors", "shutdown",
    # training: gradient clipping by the global norm
    "clip_grad_norm_",
    # the vocabulary (spmdmoe.types) and the dispatcher's output
    "Layout", "MeshAxis", "MeshLike", "Partial", "Placement", "Replicate", "Shard", "Varying", "SPMDTensor",
    "RoutedTokens", "assert_layout", "checks", "checks_enabled", "checks_mode", "layout_checked", "set_checks",
    "chunk_counts", "chunk_offset", "local_tokens", "padded_global_tokens", "padded_local_tokens", "mesh_axis",
    # errors
    "MoEConfigError", "SPMDCapacityError", "SPMDCollectiveError", "SPMDDeviceError", "SPMDDtypeError",
    "SPMDLayoutError", "SPMDMeshError", "SPMDRoutingError", "SPMDShapeError", "SPMDTokenCountError",
}


def test_top_level_names_are_the_public_api():
    names = set(spmdmoe.__all__)
    assert names == PUBLIC, ("missing", sorted(PUBLIC - names), "unlisted", sorted(names - PUBLIC))
    assert len(spmdmoe.__all__) == len(PUBLIC), "a name listed twice in spmdmoe.__all__"
    star: dict = {}
    exec("from spmdmoe import *", star)
    assert PUBLIC <= set(star), sorted(PUBLIC - set(star))


def test_each_name_is_its_defining_object():
    """A top-level name is the object its room defines (no stale copy), e.g. ``spmdmoe.check_errors`` is
    ``spmdmoe.sticky.check_errors`` and ``spmdmoe.RoutedTokens`` is ``spmdmoe.moe.transports.routed.RoutedTokens``."""
    homes = {"check_errors": "spmdmoe.sticky", "RoutedTokens": "spmdmoe.moe.transports.routed", "from_local": "spmdmoe.construct",
             "shard": "spmdmoe.construct", "padded_empty": "spmdmoe.construct", "init_mesh": "spmdmoe.meshes",
             "product_axis": "spmdmoe.meshes", "SPMDTensor": "spmdmoe.types.tensor",
             "clip_grad_norm_": "spmdmoe.moe.training.clip"}
    for name, home in homes.items():
        assert getattr(spmdmoe, name) is getattr(importlib.import_module(home), name), name
