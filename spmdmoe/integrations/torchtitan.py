"""``swap_moe``: torchtitan 0.3.0's MoE modules replaced, in place, by spmdmoe's layer.

Legend: ``B`` batch, ``L`` sequence (this rank's part of it under SP), ``D`` model dim, ``F`` expert hidden
dim, ``E`` experts, ``e`` this rank's experts, ``T = B * L`` tokens.

    from spmdmoe.integrations.torchtitan import swap_moe
    with torch.device("meta"):
        model = model_config.build()          # torchtitan's model, as torchtitan builds it
    swap_moe(model)                           # before torchtitan's parallelize (before or after init)
    model.to_empty(device=...); model.init_states(buffer_device=...)

    config.model_spec = swapped_model_spec(config.model_spec)   # the same from torchtitan's Trainer

Every parameter and buffer path of torchtitan's ``MoE`` stays, with the module objects behind most of them, so
its init, FSDP, activation checkpointing, compile, DCP and load-balancing hook keep working; the forward is
spmdmoe's. What stays, what is refused and the step hook: ``docs/torchtitan.md``, "What changes, what does not".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
from torch.distributed.tensor import DTensor

from ._torch_compat import shim_torch

shim_torch()  # torch 2.11: the names torchtitan 0.3.0 imports, before it is imported
try:
    from torchtitan.models.common.feed_forward import FeedForward as _TTFeedForward
    from torchtitan.models.common.linear import Linear as _TTLinear
    from torchtitan.models.common.moe import GroupedExperts as _TTGroupedExperts
    from torchtitan.models.common.moe import MoE as _TTMoE
    from torchtitan.models.common.moe import TokenChoiceTopKRouter as _TTRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    from torchtitan.protocols.module import Module as _TTModule
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "spmdmoe.integrations.torchtitan needs torchtitan 0.3.0 (Python >= 3.11): "
        'pip install "spmdmoe[torchtitan]"') from e

from .._dist import all_reduce
from ..moe import MoE, MoEConfig, parallelize_moe
from ..moe.experts.grouped import SharedExperts
from ..moe.layer import _Layer
from ..types.errors import MoEConfigError
from ..types.mesh import MeshLike
from ._bound import Adapter, bind, join_step_checks, local, refuse_first, shard_experts, track
from .torchtitan_modules import Experts, _Router, _SharedExperts

__all__ = ["swap_moe", "swapped_model_spec", "SwappedMoE", "Experts"]

_DISPATCHERS = (LocalTokenDispatcher, AllToAllTokenDispatcher)  # the "standard" comm backend's
_LINEARS = (nn.Linear, _TTLinear)  # a gate or shared linear spmdmoe reads the weight of: exactly these classes


class SwappedMoE(Adapter, _TTMoE):
    """torchtitan's ``MoE`` with spmdmoe's forward (see the module docstring): ``forward(x_BLD) -> out_BLD``,
    torchtitan's paths and buffers, its ``init_states``.

    Attributes: ``layer``, the spmdmoe layer that runs the forward (a :class:`spmdmoe.moe.MoE`, or a
    :class:`spmdmoe.moe.ParallelMoE` with SP / EP); it owns no parameters or saved buffers.
    """

    def __init__(self, source: _TTMoE, config: MoEConfig, layer: _Layer, expert_dtype: Optional[torch.dtype]):
        nn.Module.__init__(self)
        self.routed_experts = source.routed_experts
        self.routed_experts.inner_experts = Experts(source.routed_experts.inner_experts, config.expert_precision,
                                                    config.fp8_wgrad, expert_dtype)
        with torch.device("meta"):
            self.router = _Router(config)
        self.router.gate = source.router.gate
        self.shared_experts: Optional[SharedExperts] = None
        if source.shared_experts is not None:
            ffn = source.shared_experts
            with torch.device("meta"):
                shared = _SharedExperts(config.dim, ffn.w1.weight.shape[0])
            shared.w1, shared.w2, shared.w3 = ffn.w1, ffn.w2, ffn.w3
            self.shared_experts = shared
        self.load_balance_coeff = source.load_balance_coeff
        if source.expert_bias_E is not None:
            self.register_buffer("expert_bias_E", source.expert_bias_E, persistent=True)
        else:
            self.expert_bias_E = None
        self.register_buffer("tokens_per_expert_E", source.tokens_per_expert_E, persistent=False)
        self.training = source.training
        bind(layer, self, self.router, self.routed_experts.inner_experts, self.shared_experts)
        self._place_layer_buffers()
        self._dense_shapes = self._local_dense_shapes()  # whole, as built: tensor parallelism would shard them
        self.recomputed = False  # in a block torchtitan's activation checkpointing wraps (swapped_model_spec)

    def _local_dense_shapes(self) -> list[tuple[int, ...]]:
        """This rank's shapes of the gate's and the shared experts' weights (plain tensors under torchtitan's
        default ``spmd_types`` backend, DTensors under the others)."""
        linears = [self.router.gate] + ([] if self.shared_experts is None else
                                        [self.shared_experts.w1, self.shared_experts.w2, self.shared_experts.w3])
        return [tuple(local(lin.weight).shape) for lin in linears]

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in: its gate's, as torchtitan's MoE."""
        return self.router.gate.weight.dtype

    def before_step(self) -> None:
        """Sum the token counts over the layer's SP axis, which torchtitan's loss mesh does not include, so
        that every SP rank's load-balancing hook updates the same bias; in a block torchtitan checkpoints
        (``recomputed``, set by :func:`swapped_model_spec`), double them, since its hook halves them (it
        assumes its own MoE counted the recompute too; spmdmoe counts once)."""
        counts = local(self.tokens_per_expert_E)
        sp = getattr(self.layer, "sp", None)
        if sp is not None and sp.size > 1:
            all_reduce(counts, group=sp.group)
        if self.recomputed:
            counts.mul_(2)

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        super()._init_self_buffers(buffer_device=buffer_device)
        self.layer.reset_buffers()

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if isinstance(x_BLD, DTensor) or self._local_dense_shapes() != self._dense_shapes:
            found = (f"a DTensor input ({x_BLD.placements})" if isinstance(x_BLD, DTensor) else
                     f"its gate's and shared experts' weights sharded to {self._local_dense_shapes()} of "
                     f"{self._dense_shapes}")
            raise MoEConfigError(
                f"the swapped MoE takes this rank's plain (batch, seq, dim) tensor and whole dense weights, found "
                f"{found}: torchtitan's tensor parallelism (or its full_dtensor backend) is not supported for "
                "the MoE; set tensor_parallel_degree=1 and shard the sequence with swap_moe(sp_mesh=...) instead")
        return self.run_layer(x_BLD)


def _config(name: str, moe: _TTMoE, expert_precision: str) -> MoEConfig:
    """The :class:`MoEConfig` of torchtitan MoE ``moe``, or ``MoEConfigError`` for what it cannot express."""
    router, experts = moe.router, moe.routed_experts.inner_experts
    checks = [
        (type(router) is not _TTRouter, f"its router is a {type(router).__name__}",
         "only torchtitan.models.common.moe.TokenChoiceTopKRouter is mapped"),
        (getattr(router.gate, "bias", None) is not None, "its router gate has a bias",
         "spmdmoe's gate has none: build the gate with bias=False"),
        (bool(getattr(router, "_debug_force_load_balance", False)), "_debug_force_load_balance is set",
         "unset it (a debugging aid spmdmoe does not reproduce)"),
        (type(experts) is not _TTGroupedExperts, f"its experts are a {type(experts).__name__}",
         "FP8 / MXFP8-converted experts are not swapped: drop the converter and pass "
         "swap_moe(expert_precision='fp8_rowwise')"),
        (type(moe.routed_experts.token_dispatcher) not in _DISPATCHERS,
         f"its token dispatcher is a {type(moe.routed_experts.token_dispatcher).__name__}",
         "only comm_backend='standard' is swapped (spmdmoe moves the tokens itself)"),
    ]
    shared = moe.shared_experts
    linears = [("router gate", router.gate)]
    if type(shared) is _TTFeedForward:
        linears += [(f"shared experts' {n}", getattr(shared, n)) for n in ("w1", "w2", "w3")]
    checks += [(type(lin) not in _LINEARS, f"its {what} is a {type(lin).__module__}.{type(lin).__name__}",
                "spmdmoe computes with the weight alone, so a converted linear's forward (Float8 / MXFP8 "
                "linears, LoRA) would never run: leave the MoE's gate and shared experts out of the converter")
               for what, lin in linears]
    if shared is not None:
        checks += [
            (type(shared) is not _TTFeedForward, f"its shared experts are a {type(shared).__name__}",
             "only a plain SwiGLU FeedForward is mapped"),
            (any(getattr(lin, "bias", None) is not None for lin in (shared.w1, shared.w2, shared.w3)),
             "its shared experts' linears have a bias", "build them with bias=False"),
        ]
    refuse_first(name, checks)
    E, F, D = experts.w1_EFD.shape
    return MoEConfig(
        dim=D, hidden_dim=F, num_experts=E, top_k=router.top_k,
        num_shared_experts=0,  # the shared FFN is torchtitan's own modules, of any hidden size
        score_func=router.score_func, route_norm=router.route_norm, route_scale=router.route_scale,
        num_expert_groups=router.num_expert_groups, num_limited_groups=router.num_limited_groups,
        load_balance_coeff=moe.load_balance_coeff, router_dtype="float32",
        expert_precision=expert_precision,  # type: ignore[arg-type]
    )


def _unmapped(model: nn.Module) -> list[str]:
    """Modules that look like another MoE implementation (refused: never approximated)."""
    return [f"{name} ({type(m).__module__}.{type(m).__name__})" for name, m in model.named_modules()
            if "moe" in type(m).__name__.lower() and not isinstance(m, SwappedMoE) and type(m) is not _TTMoE
            and isinstance(m, _TTModule)]


def swap_moe(
    model: nn.Module,
    *,
    sp_mesh: Optional[MeshLike] = None,
    ep_mesh: Optional[MeshLike] = None,
    sp_mode: Literal["local", "gather"] = "local",
    ep_mode: Literal["sync", "sync_free"] = "sync",
    capacity_factor: Optional[float] = None,
    max_tokens: Optional[int] = None,
    expert_precision: Optional[Literal["bf16", "fp8_rowwise"]] = None,
    expert_dtype: Optional[torch.dtype] = torch.bfloat16,
    agree_over: Optional[MeshLike] = None,
) -> list[str]:
    """Replace every ``torchtitan.models.common.moe.MoE`` in ``model`` by a :class:`SwappedMoE`; returns their
    names. Call it on every rank, before torchtitan's ``parallelize``, on a model built on meta (as torchtitan's
    Trainer builds it), the CPU or a GPU, before or after ``init_states``: every weight keeps its value bitwise
    (under ``ep_mesh`` each rank its experts' slice), a swap without ``ep_mesh`` before ``init_states`` draws the
    same numbers as the unswapped model from the same seed (with ``ep_mesh``: initialise first, ``docs/torchtitan.md``),
    and the layer's own buffers (problem flags, capacity counters) start at zero on the model's device.

    ``sp_mesh``: an SP axis; each rank passes its own part of the sequence, ``(B, L_rank, D)``, with ``B * L_rank``
    rows following spmdmoe's chunk rule for the total (``spmdmoe.shard`` of the flattened tokens gives it; with
    ``B = 1`` any sequence length, divisible or not). One exchange per layer and forward (``spmdmoe.from_local``),
    so SP layers run eagerly (not under ``fullgraph`` compile). The layer sums its replicated weights' gradients
    over it, as tensor-parallel SP does: keep the axis out of FSDP's reduction mesh. For torchtitan's context
    parallelism leave it ``None`` (each rank routes its own chunk and FSDP reduces).
    ``ep_mesh``: the EP axis (torchtitan's ``parallel_dims.get_mesh("ep")``); the expert weights become DTensors
    sharded on it, here (torchtitan's ``parallelize`` leaves them so). ``sp_mode``, ``ep_mode``, ``capacity_factor``,
    ``max_tokens``, ``agree_over``: as :func:`spmdmoe.moe.parallelize_moe` (run here: a collective over
    ``agree_over``). ``expert_precision``:
    ``"bf16"`` (default: ``expert_dtype``) or ``"fp8_rowwise"``. ``expert_dtype``: the routed GEMMs' dtype (bf16
    as torchtitan's; ``None``: the activations').

    Raises ``MoEConfigError`` for what cannot be mapped exactly (``docs/torchtitan.md``, "Refused") and for
    a model with no torchtitan MoE.
    """
    precision = expert_precision or "bf16"
    others = _unmapped(model)
    if others:
        raise MoEConfigError(f"swap_moe: {', '.join(others)}: MoE classes other than "
                             "torchtitan.models.common.moe.MoE are not swapped (their forward may differ)")
    targets = [(n, m) for n, m in model.named_modules() if type(m) is _TTMoE]
    if not targets:
        raise MoEConfigError(f"swap_moe: {type(model).__name__} holds no torchtitan.models.common.moe.MoE "
                             "(already swapped, or not a torchtitan MoE model)")
    configs = [_config(name, moe, precision) for name, moe in targets]  # all refusals before any swap
    for (name, moe), config in zip(targets, configs):
        with torch.device("meta"):
            layer: _Layer = MoE(config)
        if sp_mesh is not None or ep_mesh is not None:
            layer = parallelize_moe(layer, sp_mesh=sp_mesh, ep_mesh=ep_mesh, sp_mode=sp_mode, ep_mode=ep_mode,
                                    capacity_factor=capacity_factor, max_tokens=max_tokens, agree_over=agree_over,
                                    device="meta")
        shard_experts(moe.routed_experts.inner_experts, layer,
                      {"w1_EFD": "experts.w1", "w2_EDF": "experts.w2", "w3_EFD": "experts.w3"})
        swapped = SwappedMoE(moe, config, layer, expert_dtype)
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent)._modules[child] = swapped
        track(swapped)
    return [n for n, _ in targets]


def swapped_model_spec(model_spec: Any, **options: Any) -> Any:
    """torchtitan's ``ModelSpec`` with a ``parallelize_fn`` that first calls :func:`swap_moe` on the model
    torchtitan's Trainer built on meta (``ep_mesh``: torchtitan's "ep" mesh when EP is on; ``options``: the
    others, e.g. ``expert_precision``), then the spec's own ``parallelize_fn``. The one line for torchtitan's
    Trainer, in a config function: ``config.model_spec = swapped_model_spec(config.model_spec)``. The Trainer
    calls ``parallelize_fn`` before ``init_weights`` (for each pipeline stage under PP), as ``swap_moe``
    needs; a seed checkpoint skips it, and its state dict is the same either way."""
    if "ep_mesh" in options:
        raise TypeError("swapped_model_spec: ep_mesh comes from torchtitan's parallel_dims; drop the argument")
    parallelize = model_spec.parallelize_fn

    def parallelize_fn(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
        if getattr(parallel_dims, "tp", 1) > 1:  # the same config on every rank: every rank raises
            raise MoEConfigError(
                f"swapped_model_spec: tensor_parallel_degree={parallel_dims.tp}: torchtitan's tensor parallelism "
                "of the MoE (its gate, shared and routed experts) is not swapped; set tensor_parallel_degree=1 "
                "and shard the sequence with swap_moe(sp_mesh=...), or keep torchtitan's own MoE")
        if any(type(m) is _TTMoE for m in model.modules()):
            swap_moe(model, ep_mesh=parallel_dims.get_mesh("ep") if parallel_dims.ep_enabled else None, **options)
        else:  # a pipeline stage without MoE layers: nothing to swap, but its ranks join the step's check
            join_step_checks()
        model = parallelize(model, parallel_dims=parallel_dims, **kwargs)
        for block in model.modules():  # what torchtitan's load-balancing hook halves the counts of
            if getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT:
                for m in block.modules():
                    if isinstance(m, SwappedMoE):
                        m.recomputed = True
        return model
    return dataclasses.replace(model_spec, parallelize_fn=parallelize_fn)
