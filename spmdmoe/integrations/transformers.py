"""``swap_moe``: Hugging Face transformers' MoE blocks replaced, in place, by spmdmoe's layer.

Legend: ``B`` batch, ``L`` sequence, ``D`` model dim, ``F`` expert hidden dim, ``E`` experts, ``K`` top-k.

    from transformers import AutoModelForCausalLM
    from spmdmoe.integrations.transformers import swap_moe
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)   # or from_config(config)
    swap_moe(model)                    # every MoE block; ep_mesh= / sp_mesh= optional
    loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss   # the model's own loss

Mapped (transformers 5, whose MoE blocks hold fused experts; ``_FAMILIES`` is the table): Qwen3-MoE, Mixtral,
DeepSeek-V3. Every parameter and buffer path stays transformers', so ``save_pretrained`` / ``from_pretrained`` read
and write the same keys; the routing, dispatch, experts and combine are spmdmoe's (with ``sp_mesh`` / ``ep_mesh``
its SP and EP). The mapping, what is kept, what is refused, the numerics and the parallelism: ``docs/porting.md``,
"transformers".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('spmdmoe.integrations.transformers needs transformers 5: pip install "spmdmoe[transformers]"'
                      ) from e

from ..moe import MoE, MoEConfig, parallelize_moe
from ..moe.experts.grouped import SharedExperts
from ..moe.layer import _Layer
from ..types.errors import MoEConfigError
from ..types.mesh import MeshLike
from ._bound import Adapter, Check, bind, local, refuse_first, shard_experts, track
from .transformers_modules import FusedExperts, HFRouter, fused_experts, keep_attributes

__all__ = ["swap_moe", "SwappedMoeBlock"]

_SILU = ("silu", "swish")  # transformers' ACT2FN names of SiLU


@dataclass(frozen=True)
class _Family:
    """One transformers MoE block class and how its options map onto :class:`MoEConfig`."""

    block: str  # "module.path:ClassName"
    options: Callable[[nn.Module], dict[str, Any]]  # block -> MoEConfig keyword arguments (routing only)
    checks: Callable[[nn.Module], list[Check]]  # block -> what it holds that spmdmoe cannot express


def _deepseek_v3(block: nn.Module) -> dict[str, Any]:
    gate = block.gate
    groups = int(gate.num_group)
    return dict(score_func="sigmoid", route_norm=bool(gate.norm_topk_prob),
                route_scale=float(gate.routed_scaling_factor), router_dtype="float32",
                num_expert_groups=groups if groups > 1 else None,
                num_limited_groups=int(gate.topk_group) if groups > 1 else None)


def _no_jitter(block: nn.Module) -> list[Check]:
    return [(float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0, f"router_jitter_noise={block.jitter_noise}",
             "set config.router_jitter_noise=0 (spmdmoe does not perturb the router input)")]


def _shared_mlp(block: nn.Module) -> list[Check]:
    mlp = block.shared_experts
    linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return [
        (not all(isinstance(lin, nn.Linear) for lin in linears), f"its shared experts are a {type(mlp).__name__} "
         "without gate_proj / up_proj / down_proj linears", "only a SwiGLU MLP is mapped"),
        (any(getattr(lin, "bias", None) is not None for lin in linears), "its shared experts' linears have a bias",
         "spmdmoe's shared experts have none"),
        (_act(mlp) not in _SILU, f"its shared experts' activation is {_act(mlp)!r}", "only SiLU (SwiGLU) is mapped"),
    ]


_FAMILIES = (
    _Family("transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeSparseMoeBlock", lambda b: dict(
        score_func="softmax", route_norm=bool(b.gate.norm_topk_prob), router_dtype="input"), lambda b: []),
    _Family("transformers.models.mixtral.modeling_mixtral:MixtralSparseMoeBlock", lambda b: dict(
        score_func="softmax", route_norm=True, router_dtype="input"), _no_jitter),
    _Family("transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3MoE", _deepseek_v3, _shared_mlp),
)


def _load(path: str) -> Optional[type]:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:  # a transformers without this model
        return None


def _families() -> dict[type, _Family]:
    return {cls: f for f in _FAMILIES if (cls := _load(f.block)) is not None}


def _act(module: nn.Module) -> Optional[str]:
    """The activation name a transformers module reads from its config (``hidden_act``), if it has one."""
    return getattr(getattr(module, "config", None), "hidden_act", None)


def _expert_checks(experts: nn.Module, act: Optional[str]) -> list[Check]:
    """What transformers' fused experts may hold that spmdmoe's grouped SwiGLU cannot compute exactly."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    fused = isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
    return [
        (isinstance(gate_up, DTensor) or isinstance(down, DTensor), "its expert weights are DTensors already "
         "(transformers' tensor parallelism, or a swapped model's experts)", "swap before any parallelism "
         "(swap_moe(..., ep_mesh=...) shards the experts itself)"),
        (not fused, f"its experts are a {type(experts).__name__} without 3-D gate_up_proj / down_proj parameters",
         "only transformers 5's fused experts are mapped"),
        (bool(getattr(experts, "has_bias", False)), "its experts have biases", "spmdmoe's experts have none"),
        (not getattr(experts, "has_gate", True), "its experts have no gate projection", "only SwiGLU is mapped"),
        (not getattr(experts, "is_concatenated", True), "its gate_up_proj interleaves gate and up rows",
         "only the concatenated [gate | up] layout is mapped"),
        (bool(getattr(experts, "is_transposed", False)), "its expert weights are transposed",
         "only the (E, 2F, D) / (E, D, F) layout is mapped"),
        (bool(getattr(experts, "has_post_expert_norm", False)), "its experts normalise their output",
         "spmdmoe's experts do not"),
        (act not in _SILU, f"its experts' activation is {act!r}", "only SiLU (SwiGLU) is mapped"),
    ]


def _config(name: str, block: nn.Module, family: _Family, precision: str, coeff: Optional[float]) -> MoEConfig:
    """The :class:`MoEConfig` of transformers block ``block``, or ``MoEConfigError`` for what it cannot express."""
    experts = block.experts
    refuse_first(name, _expert_checks(experts, _act(experts) or _act(block)) + family.checks(block))
    E, D, F = experts.down_proj.shape
    if tuple(experts.gate_up_proj.shape) != (E, 2 * F, D) or tuple(block.gate.weight.shape) != (E, D):
        raise MoEConfigError(
            f"swap_moe: {name}: expected gate.weight ({E}, {D}) and experts.gate_up_proj ({E}, {2 * F}, {D}) "
            f"beside experts.down_proj ({E}, {D}, {F}), found {tuple(block.gate.weight.shape)} and "
            f"{tuple(experts.gate_up_proj.shape)}; only transformers' own layout is mapped")
    return MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=int(block.gate.top_k),
                     expert_precision=precision,  # type: ignore[arg-type]
                     load_balance_coeff=coeff, **family.options(block))


class SwappedMoeBlock(Adapter):
    """A transformers MoE block with spmdmoe's forward (``docs/porting.md``): ``forward(hidden_BLD) -> out_BLD``
    (any leading dims), transformers' paths, parameters and buffers.

    Children: ``gate`` (transformers' router module: ``weight`` (E, D); DeepSeek-V3 also
    ``e_score_correction_bias`` (E,), which steers the choice as spmdmoe's ``expert_bias``), ``experts``
    (:class:`FusedExperts`), ``shared_experts`` (transformers' MLP, where the block has one). Attributes:
    ``layer``, the spmdmoe layer that runs the forward (a :class:`spmdmoe.moe.MoE`, or a
    :class:`spmdmoe.moe.ParallelMoE` with SP / EP); it owns no parameters or saved buffers.
    """

    def __init__(self, source: nn.Module, config: MoEConfig, layer: _Layer):
        nn.Module.__init__(self)
        keep_attributes(self, source)
        for key, module in source._modules.items():  # in transformers' order (its state dict's and parameters')
            self._modules[key] = module
        self.experts: FusedExperts = fused_experts(source.experts, config.expert_precision, config.fp8_wgrad)
        shared: Optional[SharedExperts] = None
        mlp = getattr(source, "shared_experts", None)
        if mlp is not None:
            with torch.device("meta"):
                shared = SharedExperts(config.dim, mlp.gate_proj.weight.shape[0])
            shared.w1, shared.w2, shared.w3 = mlp.gate_proj, mlp.down_proj, mlp.up_proj
        device = self.gate.weight.device
        self._own_bias = bool(config.load_balance_coeff) and getattr(self.gate, "e_score_correction_bias", None) is None
        if self._own_bias:  # the aux-loss-free update asked of a family without a bias: one, saved beside the gate's
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(config.num_experts, dtype=torch.float32, device=device))
        self.register_buffer("tokens_per_expert_E", torch.zeros(config.num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        with torch.device("meta"):
            router = HFRouter(config)
        router.gate = self.gate
        bind(layer, self, router, self.experts, shared)
        self._place_layer_buffers()

    @property
    def expert_bias_E(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        return getattr(self.gate, "e_score_correction_bias", None)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # type: ignore[override]
        was_meta = self.tokens_per_expert_E.is_meta
        out = super()._apply(fn, recurse)
        if was_meta and not self.tokens_per_expert_E.is_meta:  # to_empty: counts (and a bias of ours) start at zero
            self.tokens_per_expert_E.zero_()
            if self._own_bias:
                self.gate.e_score_correction_bias.zero_()
        return out

    def before_step(self) -> None:
        """With ``load_balance_coeff``: the aux-loss-free bias update, before each optimizer step, from the
        step's counts summed over the layer's SP, EP and data axes (``update_expert_bias``: a collective)."""
        if self.layer.config.load_balance_coeff:
            self.layer.update_expert_bias()

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in: the experts' (DeepSeek-V3 keeps its gate in fp32)."""
        return local(self.experts.down_proj).dtype

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.run_layer(hidden_states)


def _unmapped(model: nn.Module, families: dict[type, _Family]) -> list[str]:
    """Modules holding ``experts`` that are no block of the table (refused: never approximated)."""
    return [f"{name} ({type(m).__module__}.{type(m).__name__})" for name, m in model.named_modules()
            if "experts" in m._modules and type(m) not in families and not isinstance(m, SwappedMoeBlock)]


def swap_moe(
    model: nn.Module,
    *,
    sp_mesh: Optional[MeshLike] = None,
    ep_mesh: Optional[MeshLike] = None,
    ep_mode: Literal["sync", "sync_free"] = "sync",
    capacity_factor: Optional[float] = None,
    max_tokens: Optional[int] = None,
    expert_precision: Optional[Literal["bf16", "fp8_rowwise"]] = None,
    agree_over: Optional[MeshLike] = None,
    load_balance_coeff: Optional[float] = None,
) -> list[str]:
    """Replace every MoE block of transformers model ``model`` (``_FAMILIES``: which ones) by a
    :class:`SwappedMoeBlock`, in place; returns their module names. Call it on every rank, after the weights are in
    place (``from_pretrained``, ``from_config``; on meta too, but then the model's own non-persistent buffers,
    e.g. rotary frequencies, are transformers' to restore): every weight keeps its value bitwise (under
    ``ep_mesh`` each rank its experts' slice), and the layer's own buffers (problem flags, capacity counters)
    start at zero on the model's device.

    ``sp_mesh``, ``ep_mesh``, ``ep_mode``, ``capacity_factor``, ``max_tokens``, ``agree_over``: as
    :func:`spmdmoe.moe.parallelize_moe` (run here: a collective over ``agree_over``); local SP only
    (``docs/porting.md``). ``expert_precision``: ``"bf16"`` (default: the experts compute in their parameters'
    dtype) or ``"fp8_rowwise"``. ``load_balance_coeff``: the aux-loss-free load balancing (DeepSeek-V3's), off by
    default: before each optimizer step every block's bias moves by this step against its load (the counts summed
    over SP, EP and data axes), steering the choice of experts, not their weights. DeepSeek-V3 updates its own
    ``e_score_correction_bias``; Qwen3-MoE and Mixtral get one (``mlp.gate.e_score_correction_bias``, fp32 zeros,
    saved: a key the unswapped model does not load). Their own load balancing is the aux loss
    (``output_router_logits``), as in transformers (under ``sequence_parallel``, over the whole batch).

    Raises ``MoEConfigError`` for what cannot be mapped exactly (``docs/porting.md``), and for a model with no
    MoE block.

    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> from spmdmoe.integrations.transformers import swap_moe
    >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    ...     head_dim=8, num_experts=4, num_experts_per_tok=2))
    >>> swap_moe(model)
    ['model.layers.0.mlp', 'model.layers.1.mlp']
    >>> model(input_ids=torch.tensor([[1, 2, 3]]), output_router_logits=True).router_logits[0].shape
    torch.Size([3, 4])
    """
    precision = expert_precision or "bf16"
    families = _families()
    others = _unmapped(model, families)
    if others:
        raise MoEConfigError(f"swap_moe: {', '.join(others)}: not a transformers MoE block spmdmoe maps (their "
                             f"forward may differ); mapped: {', '.join(c.__name__ for c in families)}")
    targets = [(n, m) for n, m in model.named_modules() if type(m) in families]
    if not targets:
        raise MoEConfigError(f"swap_moe: {type(model).__name__} holds no transformers MoE block (already swapped, "
                             f"or not an MoE model); mapped: {', '.join(c.__name__ for c in families)}")
    hooked = [n for n, m in targets if any(hasattr(x, "_hf_hook") for x in (m, *m.children()))]
    if hooked:
        raise MoEConfigError(f"swap_moe: {', '.join(hooked)}: dispatched by accelerate (device_map / offload hooks); "
                             "swap before dispatching, or load without device_map")
    configs = [_config(name, block, families[type(block)], precision, load_balance_coeff)  # all, before any swap
               for name, block in targets]
    for (name, block), config in zip(targets, configs):
        with torch.device("meta"):
            layer: _Layer = MoE(config)
        if sp_mesh is not None or ep_mesh is not None:
            layer = parallelize_moe(layer, sp_mesh=sp_mesh, ep_mesh=ep_mesh, sp_mode="local", ep_mode=ep_mode,
                                    capacity_factor=capacity_factor, max_tokens=max_tokens, agree_over=agree_over,
                                    device="meta")
        shard_experts(block.experts, layer, {"gate_up_proj": "experts.w1", "down_proj": "experts.w2"})
        swapped = SwappedMoeBlock(block, config, layer)
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent)._modules[child] = swapped
        track(swapped)
    return [n for n, _ in targets]

