"""The ``torch.distributed`` tensor collectives under their current names, and a type test that imports nothing.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (the old names warn); torch
2.11 only has the old ones. Same semantics either way.

``is_dtensor`` answers without importing DTensor (with FSDP2, which imports it, about 1 s of every process's
``import spmdmoe`` on a 2-core CPU): no DTensor exists before its package is imported.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
reduce_scatter_list = dist.reduce_scatter  # list form: uneven chunks allowed (NCCL: grouped reduces)
all_to_all_single = dist.all_to_all_single
all_reduce = dist.all_reduce


def is_dtensor(value: Any) -> bool:
    """``isinstance(value, DTensor)``, False without importing ``torch.distributed.tensor`` when nothing has."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
