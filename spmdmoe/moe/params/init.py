"""Weight init that any shard reproduces: one seed from the caller's generator, then one generator per block.

Legend: ``E`` experts, ``F`` expert hidden dim, ``D`` model dim.

``MoE.init_weights(generator=g)`` on one device and ``layer.init_weights(generator=g)`` on a parallel
layer (each rank holding its experts and its hidden slice, every rank passing the same generator
state) give the same weights, bit for bit, so a layer built on the meta device and parallelized
never needs the full tensors anywhere:

* one int64 seed is drawn from ``g`` (the only draw from it: the generator advances alike everywhere);
* each dense parameter (router gate, shared experts) is drawn whole from a CPU generator seeded with
  ``mix(seed, name)``; each expert ``i`` of ``w1`` / ``w2`` / ``w3`` from one seeded with
  ``mix(seed, name, i)``, as its full ``(F, D)`` / ``(D, F)`` block, sliced to the rank's hidden units
  (tensor-parallel experts) and copied to the parameter's device;
* the distribution is torchtitan's: truncated normal at 3 std, std 0.02 for ``w1`` and ``init_std``
  elsewhere; ``expert_bias`` and the load counts start at zero.

Drawing on the CPU makes the values independent of the device type (CPU and CUDA ranks agree).
Parameters on the meta device are skipped (nothing to write; no draw either).
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.nn as nn

__all__ = ["init_parameters"]

_MASK = (1 << 63) - 1


def _mix(seed: int, name: str, index: int = -1) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + (index + 1) * 104_729) & _MASK


def _draw(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device="cpu")
    return nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=torch.Generator("cpu").manual_seed(seed))


@torch.no_grad()
def init_parameters(layer: nn.Module, init_std: float, generator: Optional[torch.Generator], experts: slice,
                    hidden: slice, hidden_dim: int) -> None:
    """Initialise ``layer``'s parameters (see the module docstring): its experts are the global experts
    ``experts`` restricted to the hidden units ``hidden`` of ``hidden_dim``."""
    params = [(n, p) for n, p in layer.named_parameters() if not p.is_meta]
    if params:
        device = generator.device if generator is not None else torch.device("cpu")
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())
        for name, p in params:
            std = 0.02 if name.endswith(("w1", "w1.weight")) else init_std
            if not name.startswith("experts."):
                p.copy_(_draw(tuple(p.shape), std, _mix(seed, name)))
                continue
            up = name != "experts.w2"  # w1, w3: (F, D) per expert; w2: (D, F)
            dim = p.shape[2] if up else p.shape[1]
            for local, e in enumerate(range(experts.start, experts.stop)):
                block = _draw((hidden_dim, dim) if up else (dim, hidden_dim), std, _mix(seed, name, e))
                p[local].copy_(block[hidden] if up else block[:, hidden])
    for name in ("expert_bias", "tokens_per_expert"):
        buf = getattr(layer, name, None)
        if isinstance(buf, torch.Tensor) and not buf.is_meta:
            buf.zero_()
