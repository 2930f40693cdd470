"""An spmdmoe layer run over another library's modules: :func:`bind` and :class:`Adapter`.

Legend: ``E`` experts.

A drop-in (``torchtitan.py``, ``transformers.py``) keeps the other library's module paths and parameters, so
that its init, checkpoints and hooks keep working, and runs spmdmoe's layer (the *engine*) over them. The
engine is built on meta, then :func:`bind` points its ``router`` / ``experts`` / ``shared_experts`` at
modules holding the adapter's parameters and reads its bias and load counts from the adapter (looked up at
each use: a ``.to()`` or the other library's init replaces buffers), so the engine owns no state of its
own beyond its flags. :class:`Adapter` is the mixin of the module that takes the other library's place: it
moves the engine's own buffers (problem flags; its transport's capacity counters) with itself, keeps its training
mode and runs the engine on a rank's rows (:meth:`Adapter.run_layer`). :func:`shard_experts` gives the other library's expert
parameters the layout the engine computes on (DTensors under EP); :func:`track` registers an adapter with the
process's optimizer step pre-hook (deferred problems raised on every rank, then each adapter's ``before_step``);
:func:`refuse_first` raises the first of a drop-in's refusals (a swap is never approximated).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..construct import from_local
from ..moe.params.checkpoint import expert_layout
from ..moe.params.grads import agree_grad_set
from ..moe.layer import _Layer
from ..moe.parallel.layer import ParallelMoE
from ..sticky import check_errors
from ..types.errors import MoEConfigError
from ..types.tensor import SPMDTensor

__all__ = ["Adapter", "Check", "bind", "join_step_checks", "local", "refuse_first", "shard_experts", "track"]

Check = tuple[bool, str, str]  # (refused, what was found, the fix)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a DTensor (differentiable), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


class Adapter(nn.Module):
    """Mixin of the module a drop-in puts in the other library's place. Subclasses provide
    ``expert_bias_E`` (fp32 ``(E,)`` or ``None``), ``tokens_per_expert_E`` (int64 ``(E,)``), ``compute_dtype()``
    and set ``self.layer`` (with :func:`bind`)."""

    layer: _Layer
    expert_bias_E: Optional[torch.Tensor]
    tokens_per_expert_E: torch.Tensor

    def before_step(self) -> None:
        """Run by the step hook (:func:`track`) before each optimizer step, after the deferred checks."""

    def _move_layer_buffers(self, fn: Any) -> None:
        """Apply ``fn`` to the layer's own buffers (problem flags) and its transport's (a sync-free one's
        overflow counters): they follow the adapter; fresh from meta they start at zero."""
        for holder in (self.layer, self.layer.transport):
            for name, buf in list(holder._buffers.items()):
                if buf is None:
                    continue
                moved = fn(buf)
                if buf.is_meta and not moved.is_meta:
                    moved = torch.zeros_like(moved)
                holder._buffers[name] = moved

    def _place_layer_buffers(self) -> None:
        """The layer's own buffers on the adapter's device (meta layers are built on meta)."""
        device = local(self.tokens_per_expert_E).device  # the model's: meta, the CPU or a GPU
        self._move_layer_buffers(lambda t: torch.zeros_like(t, device=device) if t.is_meta else t.to(device))
        self.layer.train(self.training)

    def run_layer(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on this rank's rows ``x`` (any leading dims, last ``D``), wrapped over the layer's SP axis
        when it has one (``spmdmoe.from_local``: one small exchange); the output as this rank's plain tensor
        of ``x``'s shape."""
        layer = self.layer
        x_TD = x.reshape(-1, x.shape[-1])
        sp = getattr(layer, "sp", None)
        out = layer(from_local(x_TD, sp) if sp is not None else x_TD)
        out_TD = out.local if isinstance(out, SPMDTensor) else out
        return out_TD.view(x.shape)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self._move_layer_buffers(fn)
        return out

    def train(self, mode: bool = True) -> "Adapter":
        super().train(mode)
        self.layer.training = mode
        return self


class _Bound:
    """A layer whose state lives in an :class:`Adapter`: the bias and counts are the adapter's (looked up at
    each use), dense weights its local tensors, the compute dtype the adapter's."""

    _owner: Adapter  # a plain attribute, not a child module (a deepcopy of the adapter copies both)

    @property
    def expert_bias(self) -> torch.Tensor:
        bias = self._owner.expert_bias_E
        return self.no_bias if bias is None else local(bias)  # type: ignore[attr-defined]

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return local(self._owner.tokens_per_expert_E)

    def dense_params(self) -> dict[str, torch.Tensor]:
        return {n: local(p) for n, p in super().dense_params().items()}  # type: ignore[misc]

    def compute_dtype(self) -> torch.dtype:
        return self._owner.compute_dtype()


_BOUND: dict[type, type] = {}


def bind(engine: _Layer, owner: Adapter, router: nn.Module, experts: nn.Module, shared: Optional[nn.Module]) -> None:
    """Point ``engine``'s modules at ``router``, ``experts`` and ``shared`` (modules holding the adapter's
    parameters) and drop its own bias and counts (see :class:`_Bound`)."""
    cls = type(engine)
    if cls not in _BOUND:
        _BOUND[cls] = type(f"Bound{cls.__name__}", (_Bound, cls), {})
    experts.grad_axis = engine.experts.grad_axis
    for name, module in (("router", router), ("experts", experts), ("shared_experts", shared)):
        engine.__dict__.pop(name, None)  # a None set before it was a module is a plain attribute
        engine._modules[name] = module
    del engine._buffers["expert_bias"], engine._buffers["tokens_per_expert"]
    engine.__class__ = _BOUND[cls]
    object.__setattr__(engine, "_owner", owner)
    object.__setattr__(owner, "layer", engine)  # not a child: it holds no state of its own
    if getattr(engine, "sp_synced", ()):  # the dense weights summed over SP: now with the shared experts
        engine.sp_synced = tuple(_Layer.dense_params(engine))
        dense = engine.dense_params()
        engine.sp_grad_set = agree_grad_set([dense[n] for n in engine.sp_synced], engine.sp)  # the adapter's
    if experts.grad_axis is not None:
        experts.grad_set = agree_grad_set(experts.read_weights(), experts.grad_axis)
    engine.register_buffer("no_bias", torch.zeros(engine.config.num_experts, device="meta"), persistent=False)


def shard_experts(experts: nn.Module, layer: _Layer, names: dict[str, str]) -> None:
    """Make ``experts``' parameters (``names``: their name -> the spmdmoe expert weight whose layout each
    takes, e.g. ``{"w1_EFD": "experts.w1"}``) DTensors of the layout the parallel ``layer`` computes on (EP:
    ``Shard(0)``; gather-mode SP: the hidden dim, ``Shard(1)`` of ``w1`` / ``w3`` and ``Shard(2)`` of ``w2``,
    by the chunk rule, which is DTensor's; both: a 2-D mesh), as spmdmoe's own checkpoints present them."""
    if not isinstance(layer, ParallelMoE):
        return
    layout = expert_layout(layer.config, layer.sp, layer.ep, layer.sp_mode, layer.expert_slice, layer.hidden_slice)
    if layout.mesh is None:
        return
    for name, ours in names.items():
        p = getattr(experts, name)
        if not isinstance(p, DTensor):
            sharded = distribute_tensor(p.data, layout.mesh, layout.placements(ours))
            setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))


_HOOK: list[Any] = []
_SWAPPED: list["weakref.ref[Adapter]"] = []
# each adapter's stepper: the first optimizer stepped that held its parameters (kept apart from the adapter, so
# that a deepcopy of it is claimed afresh)
_STEPPERS: "weakref.WeakKeyDictionary[Adapter, weakref.ref[Any]]" = weakref.WeakKeyDictionary()
_JOINED: list[Optional["weakref.ref[Any]"]] = []  # join_step_checks: [the stepper of this process's check]


def track(adapter: Adapter) -> None:
    """Register ``adapter`` with the step hook, which is registered once per process as a global optimizer
    step pre-hook (torch runs global pre-hooks before an optimizer's own)."""
    _SWAPPED.append(weakref.ref(adapter))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def join_step_checks() -> None:
    """Have this process run the step hook's :func:`spmdmoe.check_errors` (a collective) though it holds no
    swapped layer: a pipeline stage without MoE layers, whose peers' stages have some (their check would wait
    for it). The first optimizer stepped is then the one whose step runs it."""
    _JOINED[:] = [None]
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _free_or_mine(optimizer: Any, stepper: Optional["weakref.ref[Any]"]) -> bool:
    """Whether ``optimizer`` may claim what ``stepper`` (a weakref, or ``None``) names: nobody's yet, its
    optimizer gone, or ``optimizer`` itself."""
    owner = None if stepper is None else stepper()
    return owner is None or owner is optimizer


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Before an optimizer's step, for the swapped layers whose parameters it holds and that no optimizer
    stepped before it claimed (torchtitan's ``OptimizersContainer`` steps first, then its inner optimizers,
    which find theirs claimed; a layer two optimizers hold runs once a step; another model's layers in the
    same process are not this step's): raise deferred problems on every rank (:func:`spmdmoe.check_errors`),
    then those layers' :meth:`Adapter.before_step`. A process without swapped layers that joined
    (:func:`join_step_checks`) runs the check at its first optimizer's steps. No Python state changes in the
    forward, so compiled and checkpointed blocks are untouched."""
    live = _live()
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    mine = [a for a in live if _free_or_mine(optimizer, _STEPPERS.get(a)) and any(id(p) in ids for p in a.parameters())]
    joined = not live and bool(_JOINED) and _free_or_mine(optimizer, _JOINED[0])
    if not (mine or joined):
        return
    for adapter in mine:
        _STEPPERS[adapter] = weakref.ref(optimizer)
    if joined:
        _JOINED[0] = weakref.ref(optimizer)
    check_errors()
    for adapter in mine:
        adapter.before_step()


def _live() -> list[Adapter]:
    """The live swapped layers, in the order they were swapped (the same on every rank)."""
    live = [m for m in (ref() for ref in _SWAPPED) if m is not None]
    _SWAPPED[:] = [weakref.ref(m) for m in live]
    return live


def refuse_first(name: str, checks: list[Check]) -> None:
    """A drop-in's swap of module ``name``: ``MoEConfigError`` for the first of ``checks`` that holds, naming what was
    found and the fix (a swap is refused, never approximated)."""
    for bad, problem, fix in checks:
        if bad:
            raise MoEConfigError(f"swap_moe: {name}: {problem}; {fix}")
