"""The modules a swapped transformers MoE block is made of (``spmdmoe.integrations.transformers``): the
model's own parameters under spmdmoe's computation.

Legend: ``E`` experts, ``F`` expert hidden dim, ``D`` model dim, ``T`` tokens routed here, ``K`` top-k.

:func:`fused_experts` turns transformers' fused experts module (``gate_up_proj`` ``(E, 2F, D)``, ``down_proj``
``(E, D, F)``) into one that runs spmdmoe's grouped SwiGLU on the very same parameters; :class:`HFRouter`
is spmdmoe's router over transformers' gate module, which also hands the gate's forward hooks the triple
transformers' router returns, so that ``output_router_logits`` and the load-balancing loss keep working.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ..moe.experts.grouped import GroupedExperts
from ..moe.routing.router import Router, Routing
from ._bound import local

__all__ = ["FusedExperts", "HFRouter", "fused_experts", "keep_attributes"]


class FusedExperts(GroupedExperts):
    """transformers' fused expert parameters under spmdmoe's grouped SwiGLU.

    Parameters ``gate_up_proj`` (E, 2F, D): each expert's ``[gate | up]`` rows, which is spmdmoe's packed
    ``[w1 | w3]`` exactly (no copy, no repacking); ``down_proj`` (E, D, F): ``w2``. They are the parameter
    objects of the module it replaces, under its names, so ``save_pretrained`` / ``from_pretrained`` (and
    transformers' per-expert checkpoint conversion) see the same keys. Under EP they are DTensors sharded on
    dim 0; the forward reads this rank's block. ``num_experts`` is the global ``E``. The public attributes of
    the replaced module (``config``, ``hidden_dim``, ``intermediate_dim``, ``act_fn``, ...) are kept, and its
    class is a base of this one's (:func:`fused_experts`), so transformers' ``_init_weights`` still finds it.
    """

    packing = False  # gate_up_proj is packed already

    def __init__(self, source: nn.Module, precision: str, fp8_wgrad: str):
        nn.Module.__init__(self)
        keep_attributes(self, source, "num_experts")  # num_experts: the property (GroupedExperts)
        self._num_experts = int(source.gate_up_proj.shape[0])
        self.gate_up_proj, self.down_proj = source.gate_up_proj, source.down_proj
        self.set_precision(precision, fp8_wgrad)

    def read_weights(self) -> list[torch.Tensor]:
        """``[w1, w2, w3]``: views of this rank's ``gate_up_proj`` (its first and second ``F`` rows) and its
        ``down_proj``."""
        gate_up, down = local(self.gate_up_proj), local(self.down_proj)
        F = down.shape[2]
        return [gate_up[:, :F], down, gate_up[:, F:]]

    def pack(self) -> None:
        """Nothing to do: ``gate_up_proj`` is one parameter, ``[w1 | w3]`` already."""

    def unpack(self) -> None:
        """Nothing to do: ``gate_up_proj`` is one contiguous parameter, which FSDP2 shards as it is."""


def keep_attributes(target: nn.Module, source: nn.Module, *skip: str) -> None:
    """Give ``target`` the public plain attributes of the transformers module ``source`` it replaces (``config``,
    ``top_k``, ``training``, ...; not ``skip``, nor a ``forward`` set on the instance, as accelerate's hooks set
    it: that one still calls ``source``)."""
    for key, value in vars(source).items():
        if not key.startswith("_") and key != "forward" and key not in skip:
            target.__dict__[key] = value


_FUSED: dict[type, type] = {}


def fused_experts(source: nn.Module, precision: str, fp8_wgrad: str) -> FusedExperts:
    """A :class:`FusedExperts` over ``source``'s parameters, of a class derived from both :class:`FusedExperts`
    and ``type(source)`` (spmdmoe's forward first), so ``isinstance`` checks on transformers' class hold."""
    cls = type(source)
    if cls not in _FUSED:
        _FUSED[cls] = type(f"Spmdmoe{cls.__name__}", (FusedExperts, cls), {"__module__": __name__})
    return _FUSED[cls](source, precision, fp8_wgrad)


class HFRouter(Router):
    """spmdmoe's router (``forward(x_TD, expert_bias_E, gate_weight) -> Routing``) whose ``gate`` is
    transformers' gate module (it holds ``weight`` (E, D), and DeepSeek-V3's bias buffer). transformers'
    router itself never runs; after each routing, the forward hooks registered on that gate (transformers'
    ``output_router_logits`` recorder among them) are called with what transformers' router returns:
    ``(router_logits_TE, weights_TK, ids_TK)``, the logits in the dtype transformers gives them (the
    activations' for a gate GEMM in their dtype, fp32 for an fp32 gate), the weights fp32, the ids int64, for
    this rank's rows. A hook's return value is ignored (the routing is spmdmoe's)."""

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor,  # type: ignore[override]
                gate_weight: Optional[torch.Tensor] = None, keep_T: Optional[torch.Tensor] = None) -> Routing:
        r = super().forward(x_TD, expert_bias_E, gate_weight, keep_T)
        gate = self.gate
        if gate._forward_hooks:
            logits_TE = r.logits_TE if self.config.router_dtype == "float32" else r.logits_TE.to(x_TD.dtype)
            call_forward_hooks(gate, (x_TD,), (logits_TE, r.weights_TK, r.ids_TK))
        return r


def call_forward_hooks(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Call ``module``'s forward hooks, in their order, as ``module(*args)`` returning ``output`` would."""
    with_kwargs = module._forward_hooks_with_kwargs
    for hook_id, hook in list(module._forward_hooks.items()):
        if with_kwargs.get(hook_id, False):
            hook(module, args, {}, output)
        else:
            hook(module, args, output)
