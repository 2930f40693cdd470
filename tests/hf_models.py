"""Tiny transformers MoE models built from a config with random weights (no hub download), for the swap
tests (``tests/test_transformers.py``, ``tests/distributed/test_transformers.py``).

``MODELS``: name -> a function ``(seed) -> model`` (fp32, training mode, the DeepSeek-V3 correction bias set to a
non-zero ramp so it steers; DeepSeek-V3 with 2 shared experts); ``VARIANTS``: the routing options those leave at
one value (Qwen3-MoE without renormalisation, DeepSeek-V3 with one group and without renormalisation). The first of each model's layers is dense where
the model has dense layers (DeepSeek-V3's ``first_k_dense_replace``), the others MoE.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: pip install '.[transformers]'")
if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 24):  # pyproject's transformers extra
    pytest.skip(f"spmdmoe's transformers integration is tested with transformers >= 5.24 (the extra's range), found "
                f"{transformers.__version__}; on the GPU hosts carry benchmarks/hf_wheels.sh's wheels",
                allow_module_level=True)

from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM,  # noqa: E402
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB, D, E = 64, 32, 8


def qwen3(seed: int, norm_topk_prob: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01))


def mixtral(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=E, num_experts_per_tok=2, router_aux_loss_coef=0.01))


def deepseek_v3(seed: int, n_group: int = 4, topk_group: int = 2, norm_topk_prob: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E,
        num_experts_per_tok=2, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
        n_shared_experts=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        routed_scaling_factor=2.5))
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, E))
    return model


MODELS: dict[str, Callable[[int], torch.nn.Module]] = {"qwen3_moe": qwen3, "mixtral": mixtral,
                                                        "deepseek_v3": deepseek_v3}
# the routing options the models above leave at one value: only the single-process parity test takes these
VARIANTS: dict[str, Callable[[int], torch.nn.Module]] = {
    "qwen3_moe, norm_topk_prob=False": lambda seed: qwen3(seed, norm_topk_prob=False),
    "deepseek_v3, one group, norm_topk_prob=False": lambda seed: deepseek_v3(seed, 1, 1, norm_topk_prob=False),
}
