"""torchtitan 0.3.0's FSDP with expert parallelism, on a torch whose FSDP2 lacks per-parameter meshes.

With EP > 1, torchtitan 0.3.0's ``apply_fsdp_to_decoder`` gives each MoE block ONE FSDP unit whose routed-expert
parameters shard over the expert mesh (``efsdp``) and the rest over the dense one, through FSDP2's
``ShardPlacementResult`` (torch >= 2.13). torch 2.11 has none: the call raises ImportError, so torchtitan's
``parallelize_deepseekv3`` with EP cannot run there at all, swapped MoE or not.

:func:`nested_expert_fsdp` replaces that one branch, where it cannot run, by the layout torchtitan used before
(0.2): the routed experts an FSDP unit of their own on torchtitan's expert mesh (``efsdp``, with ``dp_replicate``
when HSDP is on; same placement rule: ``Shard(1)`` when ``efsdp x ep`` exceeds the experts, else ``Shard(0)``; same
mixed precision, resharding and CPU-offload settings), then torchtitan's
own call with ``ep_degree=1`` for the rest (the block's unit skips the experts' parameters, which the nested unit
already manages). Everything else (EP, gradient division off, the model-level unit) is torchtitan's; its per-block
compile is not possible with this layout (``fullgraph=True`` breaks at the nested unit's FSDP hooks).
What differs: the block's two all-gathers are separate units, and torchtitan's explicit EP prefetch order is not set
(FSDP2's implicit prefetching runs instead). Both models of a benchmark get the same layout.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any


def fsdp_meshes_per_parameter() -> bool:
    """Whether FSDP2 takes a mesh per parameter (torch 2.13's ``ShardPlacementResult``), which torchtitan 0.3.0's
    EP with FSDP needs (``torchtitan.distributed.fsdp``); torch 2.11's has none."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return hasattr(_fsdp_common, "ShardPlacementResult")


def nested_expert_fsdp() -> bool:
    """Patch torchtitan's ``apply_fsdp_to_decoder`` (in every module that bound it) where this torch lacks
    per-parameter FSDP meshes: True if patched (call before ``parallelize_fn``)."""
    import torchtitan.distributed.fsdp as titan_fsdp

    if fsdp_meshes_per_parameter():
        return False
    original = titan_fsdp.apply_fsdp_to_decoder
    if getattr(original, "_nested_experts", False):
        return True

    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_fsdp_to_decoder(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["ep_degree"] > 1:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
            from torch.distributed.tensor import Shard

            edp_mesh = a["edp_mesh"]
            if edp_mesh is None or a["edp_mesh_dims"] is not None:
                raise NotImplementedError(
                    "titan_expert_fsdp: EP > 1 needs torchtitan's efsdp mesh under the partial_dtensor backend "
                    f"(found edp_mesh={edp_mesh}, edp_mesh_dims={a['edp_mesh_dims']}); torch < 2.13 has no other")
            reshard = titan_fsdp.get_fsdp_reshard_after_forward_policy(a["reshard_after_forward_policy"],
                                                                      a["pp_enabled"])
            mp = MixedPrecisionPolicy(param_dtype=a["param_dtype"], reduce_dtype=a["reduce_dtype"],
                                      cast_forward_inputs=False)
            unit: dict[str, Any] = {"mesh": edp_mesh, "reshard_after_forward": reshard, "mp_policy": mp}
            if a["cpu_offload"]:
                unit["offload_policy"] = CPUOffloadPolicy()
            efsdp = edp_mesh["efsdp"].size()  # torchtitan's rule: the expert shards, not the HSDP replicas
            for block in a["model"].layers.values():
                if not getattr(block, "moe_enabled", False):
                    continue
                experts = block.moe.routed_experts.inner_experts
                placement = Shard(1) if efsdp * a["ep_degree"] > experts.num_experts else Shard(0)
                fully_shard(experts, shard_placement_fn=lambda _p, s=placement: s, **unit)
            a["ep_degree"], a["edp_mesh"] = 1, None
        return original(*bound.args, **bound.kwargs)
    apply_fsdp_to_decoder._nested_experts = True  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):
        if getattr(module, "apply_fsdp_to_decoder", None) is original and module.__name__.startswith("torchtitan"):
            module.apply_fsdp_to_decoder = apply_fsdp_to_decoder  # type: ignore[attr-defined]
    return True
