"""Data parallelism around parallel MoE layers: DDP, FSDP2, or a plain reduction.

After ``backward`` a model's gradients are complete along its SP axis (``grads.py``) and, for the experts, along
EP. What is left is the sum across *batches*, over a layer's batch axes (its ``dp_mesh``, and its EP axis when that
is not the SP axis): dense parameters over every batch axis, routed experts over the batch axes but EP, both
divided by the number of batches (docs/guide.md, "The MoE layer"). :func:`grad_reductions` gives this per
parameter name; :func:`reduce_grads` applies it by hand, :func:`ddp` sets DDP up with it and
:func:`spmdmoe.moe.training.fsdp.fully_shard_moe` FSDP2.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..._dist import all_gather_single, all_reduce
from ...agreement import BIT
from ...sticky import ProblemFlag
from ...types.errors import SPMDLayoutError, SPMDMeshError
from ...types.mesh import MeshAxis
from ..params.flat import flatten, split_as
from ..params.grads import GradReduction
from ..parallel.layer import ParallelMoE

__all__ = ["grad_reductions", "reduce_grads", "ddp"]

Reductions = dict[str, GradReduction]


def grad_reductions(model: nn.Module) -> Reductions:
    """Per parameter name of ``model``: its :class:`GradReduction` (every parameter, also one that does
    not require grad here: the table must not depend on what one rank freezes).

    Parameters of :class:`ParallelMoE` submodules follow :meth:`ParallelMoE.batch_reductions` (routed experts: the
    experts' reduction, the rest: the dense one); every other parameter is treated as dense (replicated over all
    batch axes). Every MoE layer must have the same batch axes. Collective over the world on the first call; call
    it on every rank, before wrapping (names are the unwrapped model's).

    >>> import spmdmoe
    >>> from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> layer = parallelize_moe(MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2)), ep_mesh=pg)
    >>> grad_reductions(layer)["experts.w1"]
    GradReduction(axis=None, divide_factor=1, axes=())
    """
    layers = [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, ParallelMoE)]
    if not layers:
        raise SPMDLayoutError(
            f"rank {dist.get_rank()}: {type(model).__name__} holds no ParallelMoE layer; without one, "
            "use DistributedDataParallel or fully_shard directly"
        )
    batch_axes = layers[0][1].batch_axes
    for prefix, layer in layers[1:]:
        if set(layer.batch_axes) != set(batch_axes):
            raise SPMDMeshError(
                f"rank {dist.get_rank()}: MoE layer {prefix!r} has batch axes {layer.batch_axes}, "
                f"layer {layers[0][0]!r} has {batch_axes}; parallelize every layer with the same "
                "dp_mesh / ep_mesh / sp_mesh"
            )
    out: Reductions = {}
    for prefix, layer in layers:
        dense_red, experts_red = layer.batch_reductions()
        for name, _ in layer.named_parameters():
            out[f"{prefix}.{name}" if prefix else name] = experts_red if name.startswith("experts.") else dense_red
    dense = layers[0][1].batch_reductions()[0]
    return {name: out.get(name, dense) for name, _ in model.named_parameters()}


def reduce_grads(model: nn.Module, reductions: Optional[Reductions] = None) -> None:
    """Apply ``reductions`` (default :func:`grad_reductions`) to ``model``'s ``.grad`` in place.

    Call on every rank after the last ``backward`` of a step, before the optimizer: one all-reduce per (group,
    dtype), gradients flattened into it. A parameter without a gradient takes part with zeros (its ``.grad`` is
    set); so does one that does not require grad on this rank (its ``.grad`` left alone), so a rank that froze a
    parameter its peers train still makes the same collectives. Each group also compares, on the device, which
    of its parameters each rank trains (docs/design.md §6): a rank that differs is raised, on every rank, by the
    next :func:`spmdmoe.check_errors` (call it before ``optimizer.step()``).
    """
    reductions = grad_reductions(model) if reductions is None else reductions
    _check_covered(model, reductions)
    items = []
    for name, p in model.named_parameters():
        if name not in reductions:
            continue
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
        items.append((reductions[name], p.grad if p.requires_grad else torch.zeros_like(p), p.requires_grad))
    for red, grads, trained in _by_reduction(items):
        flat = flatten(grads)
        if red.axis is not None:
            _agree_on_trained(red.axis, trained)
        _reduce(flat, red, async_op=False)
        _copy_back(flat, grads)  # a frozen parameter's part lands in its temporary zeros


_GRAD_SET = ProblemFlag()  # what reduce_grads finds, raised by check_errors


def _agree_on_trained(axis: MeshAxis, trained: list[bool]) -> None:
    """Record, on the device, whether this rank trains another subset of a reduction group's parameters than
    a strict majority of the group's ranks (with no majority, on 2 ranks say, every rank is recorded: none can
    be told apart as the odd one): an all-gather of one int64 per rank (a hash of the subset), no host read."""
    mine = sum((i * 2654435761 + 97) % 2147483647 for i, t in enumerate(trained) if t)  # position-weighted
    device = axis.metadata_device()
    table = torch.empty(axis.size, dtype=torch.int64, device=device)
    all_gather_single(table, torch.full((1,), mine, dtype=torch.int64, device=device), group=axis.group)  # no copy
    odd = (table == table[axis.rank]).sum() * 2 <= axis.size  # ranks holding this rank's subset: not a majority
    _GRAD_SET.record(odd.to(torch.int64) * BIT["grad_set"], device)


def ddp(module: nn.Module, reductions: Optional[Reductions] = None, **kwargs: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(module)`` whose comm hook applies ``reductions`` per parameter.

    DDP reduces every parameter over one group; here its group is the widest reduction group (dense parameters:
    dp x ep) and a comm hook reduces each bucket's parameters over their own group with their own divide factor.
    Set for you: ``init_sync=False`` (experts differ across EP ranks of that group: build the model identically on
    every rank instead, same seed) and no buffer broadcast in forward (``tokens_per_expert`` counts are per rank).
    ``kwargs`` go to DDP (e.g. ``device_ids``, ``bucket_cap_mb``); ``no_sync()`` works as usual.
    """
    reductions = grad_reductions(module) if reductions is None else reductions
    _check_covered(module, reductions)
    axes = [r.axis for r in reductions.values() if r.axis is not None]
    if not axes:
        raise SPMDMeshError(
            f"rank {dist.get_rank()}: no parameter needs a gradient reduction (no dp_mesh, and EP is the "
            "SP axis or absent): there is nothing for DDP to do; pass dp_mesh to parallelize_moe"
        )
    group = max(axes, key=lambda a: a.size).group
    key = "forward_sync_buffers"  # a newer DDP's name; older ones: broadcast_buffers
    key = key if key in inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers"
    wrapped = DistributedDataParallel(module, process_group=group, init_sync=False, **{key: False}, **kwargs)
    by_param = {id(p): reductions[name] for name, p in module.named_parameters() if name in reductions}
    wrapped.register_comm_hook(by_param, _ddp_hook)
    return wrapped


def _check_covered(model: nn.Module, reductions: Reductions) -> None:
    """Every parameter that needs a gradient has a reduction (names are the unwrapped model's)."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in reductions]
    if missing:
        raise SPMDLayoutError(
            f"rank {dist.get_rank()}: no gradient reduction for {len(missing)} parameter(s) of "
            f"{type(model).__name__}, e.g. {missing[:3]}; compute them with grad_reductions(model) on the "
            "model you pass here (names change under wrappers such as DDP's 'module.')"
        )


def _by_reduction(items: Iterable[tuple[GradReduction, torch.Tensor, bool]]
                  ) -> list[tuple[GradReduction, list[torch.Tensor], list[bool]]]:
    """``(reduction, gradient, trained here)`` items grouped by (reduction, dtype), in order of first appearance
    (the same on every rank): ``(reduction, gradients, trained flags)`` per group."""
    groups: dict[tuple[Optional[MeshAxis], int, torch.dtype], tuple[GradReduction, list[torch.Tensor], list[bool]]] = {}
    for red, g, trained in items:
        group = groups.setdefault((red.axis, red.divide_factor, g.dtype), (red, [], []))
        group[1].append(g)
        group[2].append(trained)
    return list(groups.values())


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy the consecutive parts of ``flat`` back into ``tensors`` (the inverse of flattening them)."""
    for t, part in zip(tensors, split_as(flat, [t.shape for t in tensors])):
        t.copy_(part)


def _reduce(flat: torch.Tensor, red: GradReduction, async_op: bool) -> "Optional[torch.futures.Future[Any]]":
    """``flat = sum over the group / factor``; a future when ``async_op`` and there is a collective.

    NCCL divides inside the collective (``AVG`` when the factor is the group size, else a
    pre-multiplied sum), saving a pass over the gradients; other backends divide first, then sum.
    """
    op: Any = dist.ReduceOp.SUM
    premul = getattr(dist, "_make_nccl_premul_sum", None)
    nccl = red.axis is not None and "nccl" in str(dist.get_backend(red.axis.group)) and flat.is_cuda
    if nccl and red.divide_factor == red.axis.size:
        op = dist.ReduceOp.AVG
    elif nccl and premul is not None:
        op = premul(1.0 / red.divide_factor)
    elif red.divide_factor != 1:
        flat.div_(red.divide_factor)
    if red.axis is None:
        return None
    work = all_reduce(flat, op=op, group=red.axis.group, async_op=async_op)
    return work.get_future() if async_op else None


def _ddp_hook(by_param: dict[int, GradReduction], bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: reduce each of the bucket's parameters over its own group, in place in the bucket.

    ``bucket`` is a ``dist.GradBucket``; returns a future of its buffer. (Not annotated: DDP
    checks the annotations by identity, and postponed annotations are strings.)
    """
    buf, grads = bucket.buffer(), bucket.gradients()
    groups = _by_reduction((by_param[id(p)], g, True) for p, g in zip(bucket.parameters(), grads))
    pending = []
    for red, views, _ in groups:
        flat = buf if len(groups) == 1 else flatten(views)
        pending.append((flat, views, _reduce(flat, red, async_op=True)))

    def finish(_: Any = None) -> torch.Tensor:
        for flat, views, _fut in pending:
            if flat is not buf:
                _copy_back(flat, views)
        return buf

    futures = [fut for _flat, _views, fut in pending if fut is not None]
    if not futures:
        done: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
        done.set_result(finish())
        return done
    # Chain with then(), not collect_all: then() keeps NCCL futures' CUDA events, so DDP's copy
    # of the bucket waits for the collectives on the GPU (collect_all's future has no events).
    chained = futures[0]
    for fut in futures[1:]:
        chained = chained.then(lambda _done, fut=fut: fut.wait())
    return chained.then(finish)
