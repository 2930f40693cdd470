"""What torchtitan 0.3.0 needs of torch that torch 2.11 lacks (torchtitan is written against torch 2.13).

:func:`shim_torch` supplies each missing name before torchtitan is imported; on a torch that has them it
changes nothing. ``spmdmoe.integrations.torchtitan`` calls it before its own torchtitan imports, so on torch
2.11 importing it first (``from spmdmoe.integrations.torchtitan import swap_moe``) is all a script needs; the
tests (``tests/torchtitan_models.py``) and ``benchmarks/torchtitan_model.py`` call it too. Idempotent.

=====================================================  ================================================
``torch.distributed.fsdp.DataParallelMeshDims``        imported by torchtitan's model and FSDP modules:
                                                       a dataclass ``(shard, replicate)``; only the
                                                       ``full_dtensor`` / ``spmd_types`` backends build
                                                       one, and FSDP2 of 2.11 cannot take it
``fully_shard(..., dp_mesh_dims=None)``                torchtitan always passes the keyword: dropped
                                                       when ``None``, else ``NotImplementedError``
``create_block_mask(..., separate_full_blocks=...)``   FlexAttention masks: the keyword is dropped
``torch.compiler._is_non_strict_tracing``              read by torchtitan's token dispatchers: ``False``
=====================================================  ================================================

Not supplied: FSDP2's per-parameter meshes (``ShardPlacementResult``, torch 2.13), which torchtitan's own EP
with FSDP needs (its ``parallelize`` with ``expert_parallel_degree`` > 1 fails to import it on 2.11); EP
wired by ``swap_moe(ep_mesh=...)`` does not use them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional

import torch

__all__ = ["shim_torch"]


def shim_torch() -> None:
    """Supply the names above that this torch lacks (before torchtitan is imported)."""
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            """Stub (torch < 2.13): which mesh axes FSDP shards / replicates over."""

            shard: Optional[Any] = None
            replicate: Optional[Any] = None
        DataParallelMeshDims.__module__, DataParallelMeshDims.__qualname__ = fsdp.__name__, "DataParallelMeshDims"
        fsdp.DataParallelMeshDims = DataParallelMeshDims
    if _lacks(fsdp.fully_shard, "dp_mesh_dims"):
        fsdp.fully_shard = _without_dp_mesh_dims(fsdp.fully_shard)
    if _lacks(flex.create_block_mask, "separate_full_blocks"):
        plain = flex.create_block_mask

        @functools.wraps(plain)
        def create_block_mask(*args: Any, separate_full_blocks: bool = False, **kwargs: Any) -> Any:
            return plain(*args, **kwargs)
        create_block_mask._spmdmoe_shim = True  # type: ignore[attr-defined]
        flex.create_block_mask = create_block_mask
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]


def _lacks(fn: Any, keyword: str) -> bool:
    """Whether torch's ``fn`` lacks ``keyword`` and is not a wrapper of this module's already."""
    return not getattr(fn, "_spmdmoe_shim", False) and keyword not in inspect.signature(fn).parameters


def _without_dp_mesh_dims(plain: Any) -> Any:
    """``fully_shard`` that takes torchtitan's ``dp_mesh_dims`` keyword, ``None`` only (torch < 2.13)."""
    @functools.wraps(plain)  # keeps ``fully_shard.state`` and the other attributes torch hangs on it
    def fully_shard(*args: Any, dp_mesh_dims: Any = None, **kwargs: Any) -> Any:
        if dp_mesh_dims is not None:
            raise NotImplementedError(
                f"fully_shard(dp_mesh_dims={dp_mesh_dims}) needs torch >= 2.13 (torchtitan's full_dtensor / "
                "spmd_types backends); use spmd_backend='partial_dtensor'")
        return plain(*args, **kwargs)
    fully_shard._spmdmoe_shim = True  # type: ignore[attr-defined]
    return fully_shard
