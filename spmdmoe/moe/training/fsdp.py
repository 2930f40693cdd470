"""FSDP2 around parallel MoE layers: units on the right groups, and ``SPMDTensor`` through their hooks.

:func:`fully_shard_moe` lays the units out as torchtitan does: each MoE layer's routed experts are their own unit on the
experts' group (``dp``, times ``sp`` where they are replicated along it, or the rank alone) when it differs from the
dense one (``dp x ep``, times ``sp``); the given blocks and the model are units on the dense group (see
``data_parallel.py`` for the groups and the divide factor). With SP in the group, FSDP's reduce-scatter makes the SP
sums (``grads.py``), which the layers then leave to it.

FSDP2 finds a unit's activations by walking its inputs and outputs (tensors inside tuples, lists, dicts and
dataclasses): it hooks the outputs to gather the parameters again before the unit's backward, and the inputs to reduce
the gradients right after it. An ``SPMDTensor`` is none of those containers, so a unit that returns one (also inside
such containers) would run its backward on freed parameters (torch 2.13; torch 2.11's FSDP2 walks pytrees instead, which
SPMDTensor is, and does not look inside dataclasses at all). :func:`register_spmd_hooks` puts two pairs of hooks around
FSDP's own: before FSDP looks, every ``SPMDTensor`` becomes ``(local, MARK, tensor)``; after, it is rebuilt around
whatever tensor FSDP put in ``local``'s place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, TypeVar

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...types.errors import SPMDMeshError
from ...types.tensor import SPMDTensor
from ...meshes import own_axis, product_axis
from .data_parallel import grad_reductions
from ..params.grads import leave_replicated_sums
from ..parallel.layer import ParallelMoE

__all__ = ["fully_shard_moe", "register_spmd_hooks"]

_MARK = object()  # tags a packed SPMDTensor: (local, _MARK, the SPMDTensor)
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def fully_shard_moe(model: ModuleT, *, blocks: Iterable[nn.Module] = (), **kwargs: Any) -> ModuleT:
    """FSDP2 ``fully_shard`` over ``model``, each parameter sharded over the ranks its gradient is summed over.

    torchtitan's layout (its FSDP mesh is ``dp_shard x cp``; its experts' is ``dp_shard / ep``): the given ``blocks``
    (e.g. transformer blocks, bottom-up order) and then ``model`` are units on the dense group, the batch axes (``dp``,
    and EP when it is not the SP axis) times the SP axis; each MoE layer's routed experts are a unit of their own on
    theirs when it differs: the batch axes but EP, times the SP axis where the experts are replicated along it, or this
    rank alone where EP spans every batch axis (no other rank holds these experts). FSDP's reduce-scatter then makes the
    SP sums as well, so the MoE layers and the ``replicate_grads`` modules inside ``model`` stop making their own (one
    collective where there were an all-reduce and a reduce-scatter; shards ``1 / sp`` the size). Units may take and
    return ``SPMDTensor``s (module docstring). Every unit's gradient divide factor is the number of batches; on gloo,
    which lacks PREMUL_SUM, the reductions are forced to plain sums plus scaling. ``kwargs`` go to every ``fully_shard``
    call. Returns ``model``. A collective: call it on every rank.
    Raises ``SPMDMeshError`` when the dense group is this rank alone (no ``dp_mesh``, no EP batches, no
    SP: nothing to shard over), or when the layers have different SP axes.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    grad_reductions(model)  # the layers exist and agree on their batch axes
    layers = [m for m in model.modules() if isinstance(m, ParallelMoE)]
    sp_axes = {m.sp if m.sp is not None and m.sp.size > 1 else None for m in layers}
    if len(sp_axes) > 1:
        raise SPMDMeshError(f"rank {dist.get_rank()}: fully_shard_moe shards every dense parameter over one "
                            "group, but the MoE layers have different SP axes; parallelize them alike")
    (sp,) = sp_axes
    dense = layers[0].batch_reductions()[0]
    dense_axis = product_axis(*dense.axes, sp)
    if dense_axis is None:
        raise SPMDMeshError(
            f"rank {dist.get_rank()}: FSDP shards a parameter over the ranks its gradient is summed over, but "
            "here no other rank holds a replica (no dp_mesh, no EP batches, no SP): nothing to shard over; pass "
            "dp_mesh to parallelize_moe"
        )
    units: list[tuple[nn.Module, DeviceMesh]] = []
    for layer in layers:
        layer.experts.unpack()  # FSDP2 takes contiguous parameters only
        layer.experts.fp8_cache = None  # each forward gathers the weights afresh: quantize them per call
        experts = product_axis(*layer.batch_reductions()[1].axes, layer.experts.grad_axis)
        experts = own_axis(dense_axis.device_type) if experts is None else experts
        if experts != dense_axis:
            units.append((layer.experts, experts.device_mesh()))
        if sp is not None:
            layer.leave_sp_sums_to_fsdp()
    if sp is not None:
        for m in model.modules():
            leave_replicated_sums(m, sp)
    units += [(block, dense_axis.device_mesh()) for block in blocks if block is not model]
    units.append((model, dense_axis.device_mesh()))
    gloo = "gloo" in str(dist.get_backend(dense_axis.group))  # type: ignore[union-attr]
    for unit, mesh in units:
        fully_shard(unit, mesh=mesh, **kwargs)
        register_spmd_hooks(unit)
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(float(dense.divide_factor))
        # not on a 1-rank unit: torch 2.11 and 2.13 FSDP2 divide by the factor twice there when forced to sum
        if gloo and mesh.size() > 1:
            unit.set_force_sum_reduction_for_comms(True)
    return model


def register_spmd_hooks(unit: ModuleT) -> ModuleT:
    """Let FSDP2 see the ``SPMDTensor`` inputs and outputs of ``unit``; returns ``unit``.

    Call it right after your own ``fully_shard(unit, ...)`` (``fully_shard_moe`` does it for the units it makes): its
    hooks go around the ones FSDP2 just registered (module docstring).
    """
    unit.register_forward_pre_hook(lambda m, a, k: (_pack(a), _pack(k)), prepend=True, with_kwargs=True)
    unit.register_forward_pre_hook(lambda m, a, k: (_unpack(a), _unpack(k)), with_kwargs=True)
    unit.register_forward_hook(lambda m, a, out: _pack(out), prepend=True)
    unit.register_forward_hook(lambda m, a, out: _unpack(out))
    return unit


def _pack(obj: Any) -> Any:
    if isinstance(obj, SPMDTensor):
        return (obj.local, _MARK, obj)
    return _map(obj, _pack)


def _unpack(obj: Any) -> Any:
    if isinstance(obj, tuple) and len(obj) == 3 and obj[1] is _MARK:
        local, _, x = obj
        return x if local is x.local else x.with_local(local)
    return _map(obj, _unpack)


def _map(obj: Any, fn: Any) -> Any:
    """``fn`` over the items of the containers FSDP2 walks: dicts, lists, tuples, NamedTuples and
    dataclasses (one level; ``fn`` recurses). Unchanged containers are returned as they are."""
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(fn(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: fn(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        if any(v is not getattr(obj, k) for k, v in changes.items()):
            return dataclasses.replace(obj, **changes)
    return obj
