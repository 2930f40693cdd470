"""Gradient clipping by the norm of the whole model's gradient, over every axis it is laid out on.

``torch.nn.utils.clip_grad_norm_`` on one rank sees that rank's tensors only, so each rank computes its own clip
coefficient and replicated weights drift apart. :func:`clip_grad_norm_` counts every element of the model's
gradient once and gives every rank the same coefficient. Which parameter is sharded on which axis, which axes the
model names, and how the norm is reduced: ``docs/design.md`` §5 ("Clipping").
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..._dist import all_reduce, is_dtensor
from ...agreement import alone
from ...collective_check import check_collective
from ...host import to_host
from ...meshes import product_axis
from ...types.checks import checks_mode
from ...types.errors import SPMDMeshError
from ...types.mesh import MeshAxis, mesh_axis
from ..parallel.layer import ParallelMoE

__all__ = ["clip_grad_norm_"]

Parameters = Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]
Key = frozenset[int]  # an axis by the global ranks of its group


def clip_grad_norm_(module_or_params: Parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    model: Optional[nn.Module] = None) -> torch.Tensor:
    """Clip the gradients of ``module_or_params`` in place by their global norm; return that norm.

    ``torch.nn.utils.clip_grad_norm_`` for a model laid out over SP, EP and dp axes (docs/design.md §5): the norm
    of the whole model's gradient (the single-device model's, each element once), the same on every rank, then
    every gradient times ``min(max_norm / (norm + 1e-6), 1)``. Pass the model (its spmdmoe layers say how each
    parameter is laid out); for a subset of its parameters (e.g. one optimizer group) pass them with ``model=``.
    Call it on every rank with the same parameters, after the gradients are complete: after ``backward`` (which
    sums SP-replicated gradients over SP) and the dp reduction (DDP and FSDP2 reduce in ``backward``;
    ``reduce_grads`` by hand), before ``optimizer.step()``. One all-reduce of one scalar over the product of the
    model's axes (none when it has none: then it is torch's function, bit for bit); the first call for a set of
    axes may build their product group (``spmdmoe.product_axis``, a collective over the world).

    ``norm_type``: a positive number or ``inf`` (the largest element, a max over the axes). A ``None`` gradient
    counts as zeros and stays ``None``, as in torch; the collectives do not depend on it. Returns the norm as a 0-d
    tensor, without a host read: on the device of the model's axes, float32 or wider (without axes: torch's).
    ``error_if_nonfinite``: read the norm on the host and raise ``RuntimeError`` on every rank if it is NaN or
    infinite. ``foreach``: as torch's. Axes that no layer, ``replicate_grads`` module or DTensor names (replicas
    made by hand) are not reduced over: each replica computes the norm from its own copy. Raises ``ValueError``
    for another ``norm_type``, ``TypeError`` for parameters without their model on several ranks,
    ``SPMDMeshError`` for axes that are neither orthogonal nor products of each other.

    >>> import torch, spmdmoe
    >>> from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> _ = torch.manual_seed(0)
    >>> layer = parallelize_moe(MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2)), ep_mesh=pg)
    >>> layer(torch.randn(5, 8)).sum().mul(1e4).backward()
    >>> norm = spmdmoe.clip_grad_norm_(layer, max_norm=1.0)  # one process: torch's function, bit for bit
    >>> bool(norm > 1.0), round(float(torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()])), 4)
    (True, 1.0)
    """
    with torch.no_grad():
        return _clip(module_or_params, float(max_norm), norm_type, error_if_nonfinite, foreach, model)


def _clip(module_or_params: Parameters, max_norm: float, norm_type: float, error_if_nonfinite: bool,
          foreach: Optional[bool], model: Optional[nn.Module]) -> torch.Tensor:
    p = float(norm_type)
    if not (p == math.inf or (0 < p < math.inf)):
        raise ValueError(f"clip_grad_norm_: expected norm_type a positive number or inf, found {norm_type!r}; "
                         "pass 2.0 (the default) or float('inf')")
    if isinstance(module_or_params, nn.Module):
        model = module_or_params if model is None else model
        params = list(module_or_params.parameters())
    else:
        params = [module_or_params] if isinstance(module_or_params, torch.Tensor) else list(module_or_params)
        if model is None and not alone() and not all(is_dtensor(q) for q in params):
            raise TypeError(
                f"rank {dist.get_rank()}: clip_grad_norm_ got parameters without the model that holds them, on "
                f"{dist.get_world_size()} ranks: expected the model (its spmdmoe layers say which parameters are "
                "sharded on which axis), found only tensors; pass clip_grad_norm_(model, ...), or "
                "clip_grad_norm_(params, ..., model=model) for a subset")
    layout = _Layout(model, params)
    # float32, or a wider float type of the parameters (the same on every rank: not the owned gradients')
    acc = functools.reduce(torch.promote_types, [q.dtype for q in params if q.dtype.is_floating_point], torch.float32)
    owned = [g for q, g in zip(params, layout.grads) if g is not None and layout.owner(q)]
    axis = layout.product()
    if axis is None:  # nothing is sharded or replicated across ranks: torch's norm
        total = torch.nn.utils.get_total_norm(owned, p, False, foreach)
    else:
        if checks_mode() == "collectives":
            check_collective("clip_grad_norm_", axis, None, None)
        device = axis.metadata_device()
        local = (torch.nn.utils.get_total_norm(owned, p, False, foreach).to(device, acc) if owned
                 else torch.zeros((), dtype=acc, device=device))
        total = _reduce(local, p, axis)
    if error_if_nonfinite and not to_host(torch.isfinite(total)):  # opt-in host read; the same value on every rank
        mine = float(torch.nn.utils.get_total_norm(owned, p)) if owned else 0.0
        raise RuntimeError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: clip_grad_norm_ expected a finite total "
            f"gradient norm of order {p}, found {float(total)} (this rank's own part: {mine}); find the step "
            "that made it (e.g. a NaN loss), or pass error_if_nonfinite=False to scale by it anyway")
    _scale(params, max_norm, total, foreach)
    return total


def _reduce(local: torch.Tensor, p: float, axis: MeshAxis) -> torch.Tensor:
    """The norm from every rank's ``local`` norm: ``(sum local**p)**(1/p)``, or the max (a NaN kept as NaN,
    which a MAX all-reduce may drop: it travels as a flag)."""
    if p == math.inf:
        nan = local.isnan()
        both = torch.stack([torch.where(nan, torch.zeros_like(local), local), nan.to(local.dtype)])
        all_reduce(both, op=dist.ReduceOp.MAX, group=axis.group)
        return torch.where(both[1] > 0, torch.full_like(both[0], math.nan), both[0])
    powered = local.pow(p).reshape(1)
    all_reduce(powered, group=axis.group)
    return powered[0].pow(1.0 / p)


def _scale(params: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: Optional[bool]) -> None:
    """Every gradient times ``clamp(max_norm / (total + 1e-6), max=1)``: torch's
    ``clip_grads_with_norm_`` for plain gradients, the same coefficient on a DTensor gradient's local tensor
    (DTensor's multiply refuses a plain tensor beside DTensors in one ``foreach`` call)."""
    plain = [q for q in params if q.grad is not None and not is_dtensor(q.grad)]
    torch.nn.utils.clip_grads_with_norm_(plain, max_norm, total, foreach)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch computes it
    for q in params:
        if is_dtensor(q.grad):
            local = q.grad.to_local()  # under no_grad: the DTensor's own local tensor
            local.mul_(coef.to(local.device))


class _Layout:
    """Which axes each parameter is sharded on, and the axes of the whole model, as groups of global ranks."""

    def __init__(self, model: Optional[nn.Module], params: list[torch.Tensor]):
        self.axes: dict[Key, MeshAxis] = {}  # every axis (size > 1), in the order found (the same on every rank)
        self.sharded: dict[int, set[Key]] = {}  # id(parameter) -> the axes it is sharded on
        self.grads: list[Optional[torch.Tensor]] = []  # each parameter's gradient as this rank holds it
        for m in () if model is None else model.modules():
            for layer in _layers(m):
                for a in (layer.sp, layer.ep, layer.dp):
                    self._add(a)
                split = [layer.ep] + ([layer.sp] if layer.sp_mode == "gather" else [])
                keys = {k for k in map(self._add, split) if k is not None}
                for q in layer.experts.parameters():
                    self.sharded.setdefault(id(q), set()).update(keys)
            replicated = m.__dict__.get("_spmdmoe_replicated")  # replicate_grads: (axis, names, ...)
            if replicated is not None:
                self._add(replicated[0])
        for q in params:
            self.grads.append(self._dtensor(q) if is_dtensor(q) else q.grad)
        self.primitive, self.parts = _decompose(list(self.axes.items()))

    def _add(self, axis: Optional[MeshAxis]) -> Optional[Key]:
        if axis is None or axis.size == 1:
            return None
        key = frozenset(axis.ranks)
        self.axes.setdefault(key, axis)
        return key

    def _dtensor(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        """A DTensor's mesh dims as axes, the ``Shard`` ones as the parameter's; its local gradient (a
        ``Partial`` dim reduced first, by DTensor, as its own norm would)."""
        mesh, g = q.device_mesh, q.grad
        placements = q.placements if g is None else g.placements
        for dim, placement in enumerate(placements):
            key = self._add(mesh_axis(mesh.get_group(dim)))
            if key is not None and placement.is_shard():
                self.sharded.setdefault(id(q), set()).add(key)
        if g is None:
            return None
        if not is_dtensor(g):
            return g
        if any(pl.is_partial() for pl in g.placements):
            from torch.distributed.tensor import Replicate  # a DTensor exists: DTensor is imported

            g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
        return g.to_local()

    def owner(self, q: torch.Tensor) -> bool:
        """Whether this rank is the first replica of its part of ``q``: rank 0 on every axis ``q`` is not
        sharded on."""
        sharded = set().union(*(self.parts[k] for k in self.sharded.get(id(q), ())))
        return all(a.rank == 0 for k, a in self.primitive.items() if k not in sharded)

    def product(self) -> Optional[MeshAxis]:
        """One axis over the product of the model's axes (one of them if it is that product already)."""
        everything = set(self.primitive)
        for key, parts in self.parts.items():
            if parts == everything and key in self.axes:
                return self.axes[key]
        return product_axis(*self.primitive.values())


def _layers(m: nn.Module) -> list[ParallelMoE]:
    """``m`` if it is a ``ParallelMoE``, and any held as a plain attribute (the torchtitan adapter's ``layer``)."""
    found = [m] if isinstance(m, ParallelMoE) else []
    return found + [v for v in vars(m).values() if isinstance(v, ParallelMoE) and v is not m]


def _decompose(axes: list[tuple[Key, MeshAxis]]) -> tuple[dict[Key, MeshAxis], dict[Key, set[Key]]]:
    """``(primitive axes, each axis' primitive parts)``: an axis holding others whose sizes multiply to its
    own (FSDP2's ``dp x ep`` mesh) is their product; the rest are primitive (their orthogonality is checked
    by ``product_axis``). Smallest first, ties in the order found."""
    primitive: dict[Key, MeshAxis] = {}
    parts: dict[Key, set[Key]] = {}
    for key, axis in sorted(axes, key=lambda item: item[1].size):
        inside = [k for k in primitive if k <= key]
        if not inside:
            primitive[key], parts[key] = axis, {key}
        elif math.prod(len(k) for k in inside) == axis.size:
            parts[key] = set(inside)
        else:
            raise SPMDMeshError(
                f"rank {dist.get_rank()}: clip_grad_norm_ found an axis of {axis.size} ranks {sorted(key)} holding "
                f"axes of {[len(k) for k in inside]} ranks ({[sorted(k) for k in inside]}): expected axes that are "
                "orthogonal or products of each other (as parallelize_moe's sp / ep / dp meshes and FSDP2's "
                "meshes on them are); build every mesh from one init_mesh")
    return primitive, parts
