"""torchtitan 0.3.0's FSDP with expert parallelism, on a torch whose FSDP2 lacks per-parameter meshes.

With EP > 1, torchtitan 0.3.0's ``apply_fsdp_to_decoder`` gives each MoE block ONE FSDP unit whose routed-expert
parameters shard over the expert mesh (``efsdp``) and the rest over the dense one, through FSDP2's
``ShardPlacementResult`` (torch >= 2.13). torch 2.11 has none: the call raises ImportError, so torchtitan's
``parallelize_deepseekv3`` with EP cannot run there at all, swapped MoE or not.

:func:`nested_expert_fsdp` replaces that one branch, where it cannot run, by the layout torchtitan used before
(0.2): the routed experts an FSDP unit of their own on ``efsdp`` (same placement rule: ``Shard(1)`` when
``efsdp x ep`` exceeds the experts, else ``Shard(0)``; same mixed precision and resharding policy), then torchtitan's
own call with ``ep_degree=1`` for the rest (the block's unit skips the experts' parameters, which the nested unit
already manages). Everything else (EP, compile, gradient division off, the model-level unit) is torchtitan's.
What differs: the block's two all-gathers are separate units, and torchtitan's explicit EP prefetch order is not set
(FSDP2's implicit prefetching runs instead). Both models of a benchmark get the same layout.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


def lacks_per_param_mesh() -> bool:
    """Whether this torch's FSDP2 lacks ``ShardPlacementResult`` (torchtitan 0.3.0's EP > 1 FSDP needs it)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return not hasattr(_fsdp_common, "ShardPlacementResult")


def nested_expert_fsdp() -> bool:
    """Patch torchtitan's ``apply_fsdp_to_decoder`` (in every module that bound it) where this torch lacks
    per-parameter FSDP meshes: True if patched (call before ``parallelize_fn``)."""
    import torchtitan.distributed.fsdp as titan_fsdp

    if not lacks_per_param_mesh():
        return False
    original = titan_fsdp.apply_fsdp_to_decoder
    if getattr(original, "_nested_experts", False):
        return True

    @functools.wraps(original)
    def apply_fsdp_to_decoder(model: Any, dp_mesh: Any, param_dtype: Any, reduce_dtype: Any, pp_enabled: bool,
                              *args: Any, ep_degree: int = 1, edp_mesh: Any = None, **kwargs: Any) -> Any:
        if ep_degree > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            from torch.distributed.tensor import Shard

            policy = kwargs.get("reshard_after_forward_policy", "default")
            reshard = titan_fsdp.get_fsdp_reshard_after_forward_policy(policy, pp_enabled)
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
            for block in model.layers.values():
                if not getattr(block, "moe_enabled", False):
                    continue
                experts = block.moe.routed_experts.inner_experts
                placement = Shard(1) if edp_mesh.size() * ep_degree > experts.num_experts else Shard(0)
                fully_shard(experts, mesh=edp_mesh, mp_policy=mp, reshard_after_forward=reshard,
                            shard_placement_fn=lambda _p, s=placement: s)
        return original(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, *args, **kwargs)
    apply_fsdp_to_decoder._nested_experts = True  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):
        if getattr(module, "apply_fsdp_to_decoder", None) is original and module.__name__.startswith("torchtitan"):
            module.apply_fsdp_to_decoder = apply_fsdp_to_decoder  # type: ignore[attr-defined]
    return True
