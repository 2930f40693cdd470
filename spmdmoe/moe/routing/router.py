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

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import MoEConfig

__all__ = ["Router", "Routing", "route"]


@dataclass(frozen=True)
class Routing:
    """The router's decision for ``T`` rows."""

    ids_TK: torch.Tensor  # int64 expert ids
    weights_TK: torch.Tensor  # fp32 routing weights (differentiable)
    scores_TE: torch.Tensor  # fp32 scores before the bias (differentiable; aux loss)
    logits_TE: torch.Tensor  # fp32 gate logits


class Router(nn.Module):
    """Holds the gate ``gate.weight`` (E, D); ``forward(x_TD, expert_bias)`` is :func:`route`.

    ``gate_weight`` overrides the parameter (a parallel layer passes a gradient-synced view). Forward hooks on the
    router see exactly the rows that are routed.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor, gate_weight: Optional[torch.Tensor] = None) -> Routing:
        return route(x_TD, self.gate.weight if gate_weight is None else gate_weight, expert_bias_E, self.config)


def route(x_TD: torch.Tensor, gate_ED: torch.Tensor, expert_bias_E: torch.Tensor, config: MoEConfig) -> Routing:
    """Route ``T`` valid rows (see the module docstring). No host syncs."""
    device = x_TD.device.type
    if config.router_dtype == "float32" and device != "meta" and torch.is_autocast_enabled(device):  # meta: none
        with torch.autocast(device, enabled=False):
            logits_TE = F.linear(x_TD.float(), gate_ED.float())
    elif config.router_dtype == "float32":
        logits_TE = F.linear(x_TD.float(), gate_ED.float())
    else:
        logits_TE = F.linear(x_TD, gate_ED).float()
    if config.score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    with torch.no_grad():
        choice_TE = scores_TE + expert_bias_E.float()
        if config.num_expert_groups is not None:
            choice_TE = _limit_groups(choice_TE, config)
        ids_TK = torch.topk(choice_TE, config.top_k, dim=-1).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if config.route_norm:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    # compiled, always: under dynamic=True route_scale is a symbolic float, and a test of its value would make
    # Dynamo specialise it and trace the whole layer a second time (x * 1.0 is exact; the multiply fuses)
    if torch.compiler.is_compiling() or config.route_scale != 1.0:
        weights_TK = weights_TK * config.route_scale
    return Routing(ids_TK, weights_TK, scores_TE, logits_TE)


def _limit_groups(choice_TE: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Mask (with -inf) the experts outside each row's top ``num_limited_groups`` groups."""
    T, per = choice_TE.shape[0], config.experts_per_group
    grouped_TGe = choice_TE.view(T, config.num_experts // per, per)
    top = min(2, per)
    group_scores_TG = grouped_TGe.topk(top, dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_scores_TG.topk(config.num_limited_groups, dim=-1).indices, True)
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, config.num_experts)
