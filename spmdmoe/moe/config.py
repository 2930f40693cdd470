"""``MoEConfig``: the shape and routing options of one MoE layer, validated once.

Legend: ``D`` model dim, ``F`` expert hidden dim, ``E`` experts, ``K`` top-k,
``H = num_shared_experts * F`` the shared experts' hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..types.errors import MoEConfigError

__all__ = ["MoEConfig"]

_CHOICES = (("score_func", "softmax", "sigmoid"), ("router_dtype", "float32", "input"),
            ("expert_precision", "bf16", "fp8_rowwise"), ("fp8_wgrad", "auto", "fp8", "bf16"))


@dataclass(frozen=True)
class MoEConfig:
    """Options of one MoE layer (names follow torchtitan's ``MoEArgs``).

    Args:
        dim: model dim ``D``.
        hidden_dim: expert hidden dim ``F``.
        num_experts: routed experts ``E``.
        top_k: experts per token ``K`` (``1 <= K <= E``).
        num_shared_experts: a dense SwiGLU FFN of hidden ``H = num_shared_experts * F`` added to every token.
        score_func: ``"softmax"`` or ``"sigmoid"`` of the gate logits, in fp32.
        route_norm: divide the chosen scores by their sum.
        route_scale: multiply the routing weights by this.
        num_expert_groups / num_limited_groups: DeepSeek-V3 group-limited routing: experts form
            ``num_expert_groups`` groups, a token picks its top ``num_limited_groups`` groups (by the sum of each
            group's top-2 biased scores) and chooses its K experts among them.
        load_balance_coeff: step of the aux-loss-free bias update (:meth:`MoE.update_expert_bias`); ``None``
            leaves ``expert_bias`` alone.
        aux_loss_coeff: weight of the load-balance auxiliary loss ``coeff * E * sum_e f_e * P_e`` stored on
            ``module.aux_loss`` after each training-mode forward; ``None`` computes none.
        router_dtype: dtype of the gate GEMM: ``"float32"`` (default, as torchtitan: the input and gate weight
            are cast to fp32, the weight gradient is computed in fp32 and rounded once to the parameter dtype) or
            ``"input"`` (the activations' dtype: cheaper, but with bf16 activations about 2 % of tokens pick
            another expert set).
        expert_precision: the routed experts' GEMMs: ``"bf16"`` (default: the activations' dtype) or
            ``"fp8_rowwise"`` (e4m3 operands with rowwise scales, bf16 master weights and gradients;
            ``spmdmoe.moe.experts.fp8``). The router, shared experts and combine keep the activations' dtype.
        fp8_wgrad: with ``"fp8_rowwise"``, the weight-gradient GEMMs: ``"auto"`` (default: FP8 where it pays,
            chosen from ``dim`` and ``hidden_dim`` only, never from the token count;
            ``spmdmoe.moe.experts.fp8.fp8_wgrad``), ``"fp8"`` or ``"bf16"`` (the activations' dtype, on the
            unquantized operands: the forward and input-gradient GEMMs stay FP8).

    >>> MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2).num_experts
    4
    >>> MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=5)
    Traceback (most recent call last):
    ...
    spmdmoe.types.errors.MoEConfigError: top_k must be in [1, num_experts=4], found 5; ...
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    load_balance_coeff: Optional[float] = None
    aux_loss_coeff: Optional[float] = None
    router_dtype: Literal["float32", "input"] = "float32"
    expert_precision: Literal["bf16", "fp8_rowwise"] = "bf16"
    fp8_wgrad: Literal["auto", "fp8", "bf16"] = "auto"

    def __post_init__(self) -> None:
        for name in ("dim", "hidden_dim", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MoEConfigError(f"{name} must be a positive int, found {value!r}")
        if isinstance(self.num_shared_experts, bool) or not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise MoEConfigError(f"num_shared_experts must be an int >= 0, found {self.num_shared_experts!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise MoEConfigError(
                f"top_k must be in [1, num_experts={self.num_experts}], found {self.top_k!r}; "
                "lower top_k or add experts"
            )
        for name, *allowed in _CHOICES:
            if (value := getattr(self, name)) not in allowed:
                choices = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
                raise MoEConfigError(f"{name} must be {choices}, found {value!r}")
        self._check_groups()

    def _check_groups(self) -> None:
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if groups is None:
            if limited is not None:
                raise MoEConfigError("num_limited_groups needs num_expert_groups; set both or neither")
            return
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or self.num_experts % groups:
            raise MoEConfigError(
                f"num_expert_groups must divide num_experts={self.num_experts}, found {groups!r}"
            )
        if isinstance(limited, bool) or not isinstance(limited, int) or not 1 <= limited <= groups:
            raise MoEConfigError(
                f"num_limited_groups must be in [1, num_expert_groups={groups}], found {limited!r}"
            )
        reachable = limited * (self.num_experts // groups)
        if self.top_k > reachable:
            raise MoEConfigError(
                f"top_k={self.top_k} exceeds the {reachable} experts in the {limited} chosen groups "
                f"({self.num_experts // groups} experts per group); raise num_limited_groups or lower top_k"
            )
