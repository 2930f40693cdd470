"""Token-choice top-k routing on valid rows only.

Legend: ``T`` rows routed here (valid tokens only: padding never exists outside collectives), ``D`` model dim, ``E``
experts, ``K`` top-k, ``G`` expert groups.

The gate GEMM runs in fp32 by default (``MoEConfig.router_dtype``): the rows and the gate weight are cast to fp32
(autograd rounds the weight's fp32 gradient once to the parameter dtype), so bf16 activations choose the experts an fp32
gate would, also inside ``torch.autocast`` (autocast is off for that GEMM, as torchtitan's router does). scores =
softmax or sigmoid of the logits, in fp32; the K experts are chosen on ``scores + expert_bias`` (the bias steers
selection only); the routing weights are the chosen unbiased scores, divided by their sum when ``route_norm``, times
``route_scale``. Group-limited routing (DeepSeek-V3): each group's score is the sum of its top-2 biased scores (its max
when a group has one expert); experts outside a token's top ``num_limited_groups`` groups are masked out before the
top-k.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...agreement import BIT
from ...kernels.topk_route import topk_route, topk_route_backward
from ..config import MoEConfig

__all__ = ["Router", "Routing", "route"]


@dataclass(frozen=True)
class Routing:
    """The router's decision for ``T`` rows."""

    ids_TK: torch.Tensor  # int64 expert ids
    weights_TK: torch.Tensor  # fp32 routing weights (differentiable)
    scores_TE: torch.Tensor  # fp32 scores before the bias (differentiable; aux loss)
    logits_TE: torch.Tensor  # fp32 gate logits
    counts_E: torch.Tensor  # int64 copies per expert of the rows ``keep_T`` marks (all by default)
    nonfinite: torch.Tensor  # int64 0-d: ``BIT["nonfinite"]`` if a marked row has a non-finite logit, else 0


class Router(nn.Module):
    """Holds the gate ``gate.weight`` (E, D); ``forward(x_TD, expert_bias_E, gate_weight, keep_T)`` is :func:`route`.

    ``gate_weight`` overrides the parameter (a parallel layer passes a gradient-synced view). Forward hooks on the
    router see exactly the rows that are routed.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor, gate_weight: Optional[torch.Tensor] = None,
                keep_T: Optional[torch.Tensor] = None) -> Routing:
        return route(x_TD, self.gate.weight if gate_weight is None else gate_weight, expert_bias_E, self.config,
                     keep_T)


def route(x_TD: torch.Tensor, gate_ED: torch.Tensor, expert_bias_E: torch.Tensor, config: MoEConfig,
          keep_T: Optional[torch.Tensor] = None) -> Routing:
    """Route ``T`` valid rows (see the module docstring); ``keep_T``: a bool mask of the rows counted and checked
    for non-finite logits (``None``: all). No host syncs."""
    device, fp32 = x_TD.device.type, config.router_dtype == "float32"
    off = fp32 and device != "meta" and torch.is_autocast_enabled(device)  # meta: no autocast
    with torch.autocast(device, enabled=False) if off else contextlib.nullcontext():
        logits_TE = F.linear(x_TD.float(), gate_ED.float()) if fp32 else F.linear(x_TD, gate_ED).float()
    ids_TK, weights_TK, scores_TE, tally = _TopK.apply(
        logits_TE, expert_bias_E.float(), keep_T, config.top_k, config.score_func == "sigmoid", config.route_norm,
        config.num_expert_groups, config.num_limited_groups)
    # compiled, always: under dynamic=True route_scale is a symbolic float, and a test of its value would make
    # Dynamo specialise it and trace the whole layer a second time (x * 1.0 is exact; the multiply fuses)
    if torch.compiler.is_compiling() or config.route_scale != 1.0:
        weights_TK = weights_TK * config.route_scale
    E = config.num_experts
    return Routing(ids_TK, weights_TK, scores_TE, logits_TE, tally[:E], tally[E])


class _TopK(torch.autograd.Function):
    """Scores, choice, weights, counts and the non-finite flag of the logits (``kernels/topk_route.py``: one launch
    forward, one backward on CUDA)."""

    @staticmethod
    def forward(ctx: Any, logits_TE: torch.Tensor, bias_E: torch.Tensor, keep_T: Optional[torch.Tensor], K: int,  # type: ignore[override]
                sigmoid: bool, norm: bool, groups: Optional[int], limited: Optional[int]) -> tuple[torch.Tensor, ...]:
        ctx.how = (sigmoid, norm)
        out = topk_route(logits_TE, bias_E, keep_T, K, sigmoid, norm, BIT["nonfinite"], groups, limited)
        ids_TK, w_TK, scores_TE, tally = out
        ctx.save_for_backward(scores_TE, ids_TK, w_TK)
        ctx.mark_non_differentiable(ids_TK, tally)
        ctx.set_materialize_grads(False)  # no aux loss: no zero-filled (T, E) gradient of the scores
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, _ids: None, g_w_TK: Optional[torch.Tensor], g_s_TE: Optional[torch.Tensor],  # type: ignore[override]
                 _tally: None) -> tuple[Optional[torch.Tensor], ...]:
        scores_TE, ids_TK, w_TK = ctx.saved_tensors
        if g_w_TK is None and g_s_TE is None:
            return (None,) * 8
        g_w_TK = torch.zeros_like(w_TK) if g_w_TK is None else g_w_TK
        return (topk_route_backward(scores_TE, ids_TK, w_TK, g_w_TK, g_s_TE, *ctx.how),) + (None,) * 7
