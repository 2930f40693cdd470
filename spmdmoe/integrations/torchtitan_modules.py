"""The modules a swapped torchtitan MoE is made of (``spmdmoe.integrations.torchtitan``): torchtitan's
parameters and buffers under spmdmoe's computation.

Legend: ``E`` experts, ``F`` expert hidden dim, ``D`` model dim.

:class:`Experts` holds torchtitan's routed-expert parameters and runs spmdmoe's grouped SwiGLU; the router
and shared experts are spmdmoe's, as torchtitan ``Module`` s (``_bound.bind`` points an spmdmoe layer at them).
Imported by ``torchtitan.py`` after its check that torchtitan is installed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..moe.experts.grouped import GroupedExperts, SharedExperts
from ..moe.routing.router import Router
from ._bound import local
from ._torch_compat import shim_torch

shim_torch()  # torch 2.11 (see torchtitan.py), also where this module is imported first
from torchtitan.models.common.moe import GroupedExperts as _TTGroupedExperts  # noqa: E402
from torchtitan.protocols.module import Module as _TTModule  # noqa: E402

__all__ = ["Experts"]


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
        weights = [local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)]
        return weights if self.dtype is None else [w.to(self.dtype) for w in weights]

    def forward(self, routed: Any, later: Any = None) -> torch.Tensor:
        dtype = routed.x_RD.dtype
        if self.dtype is None or dtype == self.dtype:
            return super().forward(routed, later)
        return super().forward(dataclasses.replace(routed, x_RD=routed.x_RD.to(self.dtype)), later).to(dtype)


class _Router(Router, _TTModule):
    """spmdmoe's router as a torchtitan ``Module`` (its ``verify_module_protocol`` accepts the model)."""


class _SharedExperts(SharedExperts, _TTModule):
    """spmdmoe's shared experts as a torchtitan ``Module``."""
