"""torchtitan 0.3.0 models for the swap tests (``tests/test_torchtitan.py``, ``tests/distributed/test_torchtitan.py``).

torchtitan's FlexAttention has no backward on CPU, so both models (torchtitan's and the swapped one) get
torchtitan's own causal ``ScaledDotProductAttention``. ``build`` makes the model on meta, optionally swaps,
materialises it and runs torchtitan's ``init_states`` from one seed, as torchtitan's trainer does (or builds
it on the device, or swaps after the init: the other ways a script may take). On torch 2.11, ``shim_torch``
(``spmdmoe/integrations/_torch_compat.py``) supplies what torchtitan 0.3.0 takes from torch 2.13, before
torchtitan's models are imported.
"""

from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any, Callable, Optional

import pytest
import torch

from spmdmoe.integrations._torch_compat import shim_torch

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
shim_torch()  # torch 2.11: the names torchtitan imports (spmdmoe.integrations.torchtitan applies it too)

from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from titan_expert_fsdp import fsdp_meshes_per_parameter  # noqa: E402,F401  (the tests' skip conditions)


def debug_config(layers: int = 3, flavor: str = "debugmodel", sdpa: bool = True, **moe: Any) -> Any:
    """torchtitan's DeepSeek-V3 ``flavor`` (default its debug model: dim 256, 8 experts, top 3, 1 shared
    expert), its first ``layers`` blocks (the first dense); ``sdpa``: torchtitan's causal SDPA attention
    instead of FlexAttention; ``moe`` overrides router options (e.g. ``score_func="sigmoid"``)."""
    config = model_registry(flavor).model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        if sdpa:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is not None:
            for key, value in moe.items():
                setattr(layer.moe.router, key, value)
    return config


def build(config: Any, swap: Optional[Callable[[Any], Any]] = None, seed: int = 0, device: str = "cpu", *,
          on_meta: bool = True, swap_after_init: bool = False) -> torch.nn.Module:
    """``config`` built on meta and materialised on ``device`` (``on_meta=False``: built on ``device``
    itself), initialised from ``seed`` by torchtitan's ``init_states``; ``swap(model)`` applied before the
    materialisation and init (``swap_after_init``: after them)."""
    with torch.device("meta" if on_meta else device):
        model = config.build()
    if swap is not None and not swap_after_init:
        swap(model)
    if on_meta:
        model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    if swap is not None and swap_after_init:
        swap(model)
    return model


def pair(config: Any, seed: int = 0, device: str = "cpu") -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(torchtitan's model, the swapped one)``, both built from ``config`` and initialised from ``seed``."""
    from spmdmoe.integrations.torchtitan import swap_moe

    return build(copy.deepcopy(config), None, seed, device), build(config, swap_moe, seed, device)


class NoParallelism:
    """What torchtitan's load-balancing hook reads of ``ParallelDims`` in a one-process job."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, name: str) -> None:
        return None
