"""The modules a swapped torchtitan MoE is made of (``spmdmoe.integrations.torchtitan``): torchtitan's
parameters and buffers under spmdmoe's computation.

Legend: ``E`` experts, ``F`` expert hidden dim, ``D`` model dim.

:class:`Experts` holds torchtitan's routed-expert parameters and runs spmdmoe's grouped SwiGLU; the router
and shared experts are spmdmoe's, as torchtitan ``Module`` s; :func:`_bind` points an spmdmoe layer at them
and at the adapter's bias and count buffers, so the layer owns no state of its own. Imported by
``torchtitan.py`` after its check that torchtitan is installed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..moe.experts import GroupedExperts, SharedExperts
from ..moe.grads import agree_grad_set
from ..moe.layer import _Layer
from ..moe.router import Router
from ._torch_compat import shim_torch

shim_torch()  # torch 2.11 (see torchtitan.py), also where this module is imported first
from torchtitan.models.common.moe import GroupedExperts as _TTGroupedExperts  # noqa: E402
from torchtitan.protocols.module import Module as _TTModule  # noqa: E402

if TYPE_CHECKING:
    from .torchtitan import SwappedMoE

__all__ = ["Experts"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a DTensor (differentiable), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


class Experts(GroupedExperts, _TTModule):
    """torchtitan's routed-expert parameters under spmdmoe's grouped SwiGLU.

    Parameters ``w1_EFD`` (E, F, D), ``w2_EDF`` (E, D, F), ``w3_EFD`` (E, F, D): the very parameters of the
    torchtitan ``GroupedExperts`` it replaces, with its ``param_init``, so torchtitan's ``init_states``
    treats them as its own. Not its sharding config: the spmdmoe layer decides their layout, and
    torchtitan's ``parallelize`` leaves them as ``swap_moe`` made them (DTensors sharded on dim 0 under EP,
    on the hidden dim under gather-mode SP; the forward reads this rank's blocks). ``dtype``: the GEMMs' dtype (``None``: the activations'); rows and
    weights are cast to it and the output back, as torchtitan's experts do. ``num_experts`` is the global
    ``E`` (torchtitan sizes its MoE buffers by it).
    """

    def __init__(self, source: _TTGroupedExperts, precision: str, fp8_wgrad: str, dtype: Optional[torch.dtype]):
        nn.Module.__init__(self)
        self.dtype = dtype
        self._num_experts = int(source.num_experts)
        self.w1_EFD, self.w2_EDF, self.w3_EFD = source.w1_EFD, source.w2_EDF, source.w3_EFD
        self._param_init = source._param_init
        self.set_precision(precision, fp8_wgrad)

    @property
    def num_experts(self) -> int:  # type: ignore[override]
        return self._num_experts

    # GroupedExperts reads and packs w1 / w2 / w3: torchtitan's parameters under our names
    w1 = property(lambda self: self.w1_EFD)
    w2 = property(lambda self: self.w2_EDF)
    w3 = property(lambda self: self.w3_EFD)

    def pack(self) -> None:
        """Packed ``w1 | w3`` (``GroupedExperts.pack``) once materialised: on meta they stay apart, as
        FSDP2 (which torchtitan may apply before ``to_empty``) takes contiguous parameters only."""
        if not self.w1_EFD.is_meta:
            super().pack()

    def _init_self_parameters(self) -> None:
        """torchtitan's ``param_init``, on contiguous tensors (a CPU generator fills a strided view in another
        order), packed again after."""
        for p in (self.w1_EFD, self.w3_EFD):
            if not isinstance(p, DTensor):
                p.data = p.data.contiguous()
        super()._init_self_parameters()
        self.pack()

    def read_weights(self) -> list[torch.Tensor]:
        weights = [_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)]
        return weights if self.dtype is None else [w.to(self.dtype) for w in weights]

    def forward(self, routed: Any) -> torch.Tensor:
        dtype = routed.x_RD.dtype
        if self.dtype is None or dtype == self.dtype:
            return super().forward(routed)
        return super().forward(dataclasses.replace(routed, x_RD=routed.x_RD.to(self.dtype))).to(dtype)


class _Router(Router, _TTModule):
    """spmdmoe's router as a torchtitan ``Module`` (its ``verify_module_protocol`` accepts the model)."""


class _SharedExperts(SharedExperts, _TTModule):
    """spmdmoe's shared experts as a torchtitan ``Module``."""


class _Bound:
    """A layer whose state lives in a :class:`SwappedMoE`: the bias and counts are the adapter's buffers
    (looked up at each use: torchtitan re-creates them in ``init_states``), dense weights its local
    tensors."""

    _owner: "SwappedMoE"  # a plain attribute, not a child module (a deepcopy of the adapter copies both)

    @property
    def expert_bias(self) -> torch.Tensor:
        bias = self._owner.expert_bias_E
        return self.no_bias if bias is None else _local(bias)  # type: ignore[attr-defined]

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return _local(self._owner.tokens_per_expert_E)

    def dense_params(self) -> dict[str, torch.Tensor]:
        return {n: _local(p) for n, p in super().dense_params().items()}  # type: ignore[misc]


_BOUND: dict[type, type] = {}


def _bind(engine: _Layer, adapter: "SwappedMoE") -> None:
    """Point ``engine``'s modules at the adapter's and drop its own bias and counts (see :class:`_Bound`)."""
    cls = type(engine)
    if cls not in _BOUND:
        _BOUND[cls] = type(f"Bound{cls.__name__}", (_Bound, cls), {})
    adapter.routed_experts.inner_experts.grad_axis = engine.experts.grad_axis
    for name, module in (("router", adapter.router), ("experts", adapter.routed_experts.inner_experts),
                         ("shared_experts", adapter.shared_experts)):
        engine.__dict__.pop(name, None)  # a None set before it was a module is a plain attribute
        engine._modules[name] = module
    del engine._buffers["expert_bias"], engine._buffers["tokens_per_expert"]
    engine.__class__ = _BOUND[cls]
    object.__setattr__(engine, "_owner", adapter)
    if getattr(engine, "sp_synced", ()):  # the dense weights summed over SP: now with the shared experts
        engine.sp_synced = tuple(_Layer.dense_params(engine))
        dense = engine.dense_params()
        engine.sp_grad_set = agree_grad_set([dense[n] for n in engine.sp_synced], engine.sp)  # the adapter's
    inner = adapter.routed_experts.inner_experts
    if inner.grad_axis is not None:
        inner.grad_set = agree_grad_set(inner.read_weights(), inner.grad_axis)
    engine.register_buffer("no_bias", torch.zeros(engine.config.num_experts, device="meta"), persistent=False)
