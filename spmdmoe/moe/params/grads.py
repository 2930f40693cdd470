"""Gradients of parameters replicated along an SP axis (docs/design.md §5).

A parameter replicated along an SP axis (router, shared experts, attention, norms; experts when they are not split
along that axis) gets a partial gradient on each rank. :func:`sync_grads` sums the *fresh* gradients over SP at the
parameter's use, before they are accumulated into ``.grad``, once per forward call on every rank. The reduction
across replicas holding different batches comes after ``backward``: :class:`GradReduction` describes it,
``data_parallel.py`` carries it out. Why at the use, and what follows: ``docs/design.md`` §5 ("Plans").
"""

from __future__ import annotations

import math
import types
import weakref
import zlib
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..._dist import all_reduce
from ...agreement import BIT, Field, Problem, agree
from ...collective_check import check_collective
from ...meshes import product_axis
from ...sticky import ProblemFlag
from ...types.checks import checks_mode
from ...types.errors import SPMDLayoutError
from ...types.mesh import MeshAxis, MeshLike, mesh_axis
from .flat import by_dtype, split_as
from .overlap import Join, active_join, call_joined

__all__ = ["sync_grads", "agree_grad_set", "replicate_grads", "GradReduction", "batch_reductions"]


class _SyncGrads(torch.autograd.Function):
    """Views (or casts to ``dtypes``) forward; backward sums the incoming gradients over the axis:
    here and now, or, inside a joined call, launched for its join to wait for (``overlap.py``)."""

    @staticmethod
    def forward(ctx: Any, axis: MeshAxis, join: Optional[Join], dtypes: list[torch.dtype],  # type: ignore[override]
                token: Optional[torch.Tensor], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.axis, ctx.join, ctx.in_dtypes = axis, join, [t.dtype for t in tensors]
        if join is not None:
            ctx.slots = [join.slots[id(t)] for t in tensors]
        return tuple(t.view_as(t) if d == t.dtype else t.to(d) for t, d in zip(tensors, dtypes))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        if ctx.join is not None and ctx.join.joins_this_backward():  # the join hands the sums over
            ctx.join.launch(ctx.axis.group, ctx.slots, grads)
            return (None,) * (4 + len(grads))
        out: list[Optional[torch.Tensor]] = [None] * len(grads)
        for idx, flat in by_dtype(grads):
            if flat.numel():
                all_reduce(flat, group=ctx.axis.group)
            for i, part in zip(idx, split_as(flat, [grads[i].shape for i in idx])):
                out[i] = part.to(ctx.in_dtypes[i])
        return (None, None, None, None, *out)


def sync_grads(tensors: Sequence[torch.Tensor], mesh: MeshLike,
               dtypes: Optional[Sequence[torch.dtype]] = None, *,
               agreed: Optional[Sequence[bool]] = None) -> list[torch.Tensor]:
    """Views of ``tensors`` whose backward sums their fresh gradients over ``mesh``.

    Use the returned views in place of the parameters in the forward; every rank of the axis must call this once
    per forward, with the same tensors in the same order (also a rank with no tokens). ``dtypes``: cast the views
    (e.g. a bf16 router weight read in fp32); the gradients are then summed in that dtype and rounded once. A
    1-rank axis, or grad mode off, returns the tensors (cast) without a reduction.

    Which tensors need a gradient is agreed once, eagerly: ``agreed`` is the set :func:`agree_grad_set` returned
    for these tensors on this axis (``parallelize_moe`` and ``replicate_grads`` keep it as a plain attribute; one
    of another length raises ``ValueError``). Without ``agreed`` an eager call agrees at its call site's first
    call, in any grad mode (one small check exchange and a host read); ranks that differ raise the same
    ``SPMDLayoutError`` on every rank. Freeze parameters before the set is agreed. Inside a joined call covering
    ``tensors`` (``spmdmoe.moe.params.overlap``) the sum is launched asynchronously and waited for at the call's
    input. Under ``torch.compile``, later calls, grad mode: ``docs/design.md`` §5 and §6.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> (v,) = spmdmoe.moe.sync_grads([w], pg)
    >>> (3 * v).sum().backward(); w.grad
    tensor([3., 3.])
    """
    axis = mesh_axis(mesh)
    tensors = list(tensors)
    dtypes = [t.dtype for t in tensors] if dtypes is None else list(dtypes)
    mask = tuple(t.requires_grad for t in tensors)
    if axis.size > 1 and checks_mode() == "collectives":  # grad mode and the set compared, also with grad off
        check_collective("sync_grads", axis, None, None, {"needs_grad": [i for i, m in enumerate(mask) if m]})
    if axis.size == 1:
        return [t if d == t.dtype else t.to(d) for t, d in zip(tensors, dtypes)]
    if agreed is None:  # in any grad mode: grad mode must not decide that it runs
        agreed = mask if torch.compiler.is_compiling() else _agreed_at_call_site(axis, tensors, mask)
    agreed = tuple(agreed)
    if len(agreed) != len(mask):
        raise ValueError(f"rank {axis.rank}: sync_grads got {len(mask)} tensors but an agreed set of "
                         f"{len(agreed)}; pass the set agree_grad_set returned for these tensors")
    if mask != agreed and torch.is_grad_enabled():
        _record_changed_set(axis, tensors, mask, agreed)
    if not torch.is_grad_enabled() or not any(agreed):
        return [t if d == t.dtype else t.to(d) for t, d in zip(tensors, dtypes)]
    join = None if torch.compiler.is_compiling() else active_join()
    if join is not None and not join.covers(tensors):
        join = None
    token = None if join is None else join.token
    if not any(mask) and (token is None or not token.requires_grad):  # stand in: the node the peers
        token = torch.zeros((), device=tensors[0].device, requires_grad=True)  # record, reached from a leaf
    return list(_SyncGrads.apply(axis, join, dtypes, token, *tensors))


# the requires-grad set each eager sync_grads call without ``agreed`` agreed on at its first call:
# (group, tensors) -> (refs, set). Never consulted while tracing.
_AGREED: dict[tuple[int, tuple[int, ...]], tuple[list["weakref.ref[torch.Tensor]"], tuple[bool, ...]]] = {}
_SYNC_SET = ProblemFlag()  # a forward whose set differs from the agreed one; raised by check_errors
_SET = Field("set of tensors that need a gradient", show=lambda v: f"#{v:x}",
             fix="freeze (requires_grad_(False)) the same parameters on every rank")


def agree_grad_set(tensors: Sequence[torch.Tensor], mesh: MeshLike) -> tuple[bool, ...]:
    """Agree now, eagerly, on which of ``tensors`` need a gradient; returns the agreed set (one bool per tensor)
    to pass as ``agreed`` to the :func:`sync_grads` calls over these tensors and ``mesh`` (``replicate_grads`` and
    ``parallelize_moe`` keep it as a plain attribute). Every rank must call it alike, outside ``torch.compile``
    (else ``RuntimeError``); ranks whose sets differ raise the same ``SPMDLayoutError``: one small check exchange
    and a host read (none on a 1-rank axis).

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.moe.agree_grad_set([torch.nn.Parameter(torch.ones(2)), torch.ones(2)], pg)
    (True, False)
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("agree_grad_set exchanges and reads on the host: call it eagerly, outside "
                           "torch.compile (e.g. where the module is wrapped), and pass its set to sync_grads")
    axis = mesh_axis(mesh)
    mask = tuple(t.requires_grad for t in tensors)
    if axis.size > 1 and mask:
        agree("sync_grads", axis, Problem(), [(_SET, zlib.crc32(bytes(mask)))])
    return mask


def _agreed_at_call_site(axis: MeshAxis, tensors: list[torch.Tensor], mask: tuple[bool, ...]) -> tuple[bool, ...]:
    """Eager only: the set agreed at this call site's (these tensors on ``axis``) first call, agreeing now
    (:func:`agree_grad_set`) if it is the first."""
    key = (id(axis.group), tuple(id(t) for t in tensors))
    entry = _AGREED.get(key)
    if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors)):
        return entry[1]
    agreed = agree_grad_set(tensors, axis)
    if len(_AGREED) > 4096:  # call sites whose tensors are gone
        for k in [k for k, (refs, _) in _AGREED.items() if any(r() is None for r in refs)]:
            del _AGREED[k]
    _AGREED[key] = ([weakref.ref(t) for t in tensors], agreed)
    return agreed


def _record_changed_set(axis: MeshAxis, tensors: list[torch.Tensor], mask: tuple[bool, ...],
                        agreed: tuple[bool, ...]) -> None:
    """A forward with grad on whose set differs from the agreed one: recorded (no sync) and raised by
    :func:`spmdmoe.check_errors`; this rank follows the agreed set, so the collectives still match."""
    changed = [i for i, (a, b) in enumerate(zip(mask, agreed)) if a != b]
    detail = (f"rank {axis.rank} of {axis}: sync_grads over tensors {changed} (of {len(mask)}) that "
              f"{'need' if mask[changed[0]] else 'no longer need'} a gradient here, unlike the set the ranks "
              "agreed on; freeze or unfreeze parameters before parallelize_moe / replicate_grads wrap them, "
              "on every rank")
    _SYNC_SET.record(BIT["grad_set"], tensors[0].device, [] if detail in _SYNC_SET.details else [detail])


def replicate_grads(
    module: nn.Module, mesh: MeshLike, *, include: Optional[Callable[[str], bool]] = None, overlap: bool = True
) -> nn.Module:
    """Make ``module``'s replicated parameters get SP-summed gradients; returns ``module``.

    Wraps ``module.forward`` (in place; parameter names, ``state_dict`` and optimizers are unchanged): during each
    call the parameters (those whose name ``include`` accepts, default all that require grad) are swapped for
    :func:`sync_grads` views. For model code such as attention and norm weights replicated along the SP axis. Call
    it once per module (twice raises ``SPMDLayoutError``). Each call is a joined call on its first tensor argument
    (``spmdmoe.moe.params.overlap``): the sums wait at that input's gradient, or at an enclosing
    :func:`spmdmoe.moe.overlap_grads` module's; ``overlap=False``: at their use.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> lin = spmdmoe.moe.replicate_grads(torch.nn.Linear(2, 2), pg)
    >>> lin(torch.ones(1, 2)).shape
    torch.Size([1, 2])
    """
    axis = mesh_axis(mesh)
    if getattr(module, "_spmdmoe_replicated", None) is not None:
        raise SPMDLayoutError(
            f"rank {axis.rank}: replicate_grads was already applied to this {type(module).__name__}; "
            "applying it twice would reduce its gradients twice"
        )
    names = [n for n, p in module.named_parameters() if p.requires_grad and (include is None or include(n))]
    agreed = agree_grad_set([module.get_parameter(n) for n in names], axis)  # one rank's frozen parameter: raised
    paths: dict[int, list[str]] = {}  # a tied parameter (e.g. embeddings and output head) sits under several names
    for n, p in module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(n)
    aliases = tuple(tuple(paths[id(module.get_parameter(n))]) for n in names)
    object.__setattr__(module, "_spmdmoe_replicated", (axis, names, overlap, agreed, aliases))
    object.__setattr__(module, "_spmdmoe_replicate_inner", module.forward)
    object.__setattr__(module, "forward", types.MethodType(_replicated_forward, module))
    object.__setattr__(module, "_spmdmoe_sync_params", types.MethodType(_replicated_params, module))
    return module


def leave_replicated_sums(module: nn.Module, axis: MeshAxis) -> None:
    """If ``replicate_grads`` wrapped ``module`` over ``axis``: make no sums from now on (FSDP2 on a group
    that spans ``axis`` makes them in its reduce-scatter; ``fully_shard_moe`` calls it). Else nothing."""
    replicated = module.__dict__.get("_spmdmoe_replicated")
    if replicated is not None and replicated[0] == axis:
        object.__setattr__(module, "_spmdmoe_replicated", (axis, [], replicated[2], (), ()))


def _replicated_params(self: nn.Module) -> list[torch.Tensor]:
    """The parameters a joined call defers the sums of (``overlap.sync_params``): none with
    ``overlap=False`` or a 1-rank axis."""
    axis, names, overlap, _, _ = self._spmdmoe_replicated
    return [self.get_parameter(n) for n in names] if axis.size > 1 and overlap else []


def _replicated_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``replicate_grads``' forward: a method bound to the module (``deepcopy`` rebinds it to the copy)."""
    axis, names, overlap, agreed, aliases = self._spmdmoe_replicated
    if not names:  # nothing to sum (leave_replicated_sums)
        return self._spmdmoe_replicate_inner(*args, **kwargs)
    # every name a parameter sits under takes its one view: a tied parameter's uses add up before the one sum
    entries = [[(self.get_submodule(owner), leaf) for owner, _, leaf in (n.rpartition(".") for n in group)]
               for group in aliases]

    def body(*args: Any, **kwargs: Any) -> Any:
        params = [places[0][0]._parameters[places[0][1]] for places in entries]
        views = sync_grads(params, axis, agreed=agreed)  # type: ignore[arg-type]
        for places, view in zip(entries, views):
            for owner, leaf in places:
                owner._parameters[leaf] = view  # type: ignore[assignment]
        try:
            return self._spmdmoe_replicate_inner(*args, **kwargs)
        finally:
            for places, p in zip(entries, params):
                for owner, leaf in places:
                    owner._parameters[leaf] = p

    return call_joined(body, args, kwargs, self._spmdmoe_sync_params) if overlap else body(*args, **kwargs)


class GradReduction(NamedTuple):
    """What a parameter's gradient still needs after ``backward``: a sum over ``axis``, then ``/ divide_factor``.

    ``axis`` is ``None`` when no other rank holds a replica seeing other batches; the division still applies.
    ``axes`` are the mesh axes ``axis`` spans (e.g. ``(dp, ep)``: ``axis`` is their product group), for a sum in
    stages. ``divide_factor`` is the number of batches one optimizer step sees (docs/guide.md, "The MoE layer").
    ``mesh`` is the axis as a 1-D ``DeviceMesh`` (for ``fully_shard``).
    """

    axis: Optional[MeshAxis]
    divide_factor: int
    axes: tuple[MeshAxis, ...] = ()

    @property
    def mesh(self) -> Optional[DeviceMesh]:
        return None if self.axis is None else self.axis.device_mesh()


def batch_reductions(batches: tuple[MeshAxis, ...], ep: Optional[MeshAxis]) -> tuple[GradReduction, GradReduction]:
    """``(dense, experts)`` of a layer whose ranks on ``batches`` hold other batches (its ``batch_axes``).

    Dense parameters are replicated over every batch axis; the experts already hold every EP batch's contribution, so
    they need only the batch axes other than ``ep``. Both divide by the number of batches one step sees (the product of
    the batch axes' sizes). A collective over the world when the product group is new (:func:`spmdmoe.product_axis`).
    """
    factor = math.prod(a.size for a in batches)
    expert_batches = tuple(a for a in batches if a != ep)
    return (GradReduction(product_axis(*batches), factor, batches),
            GradReduction(product_axis(*expert_batches), factor, expert_batches))
