"""The ``torch.distributed`` tensor collectives under their current names.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (the old names warn); torch
2.11 only has the old ones. Same semantics either way.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
reduce_scatter_list = dist.reduce_scatter  # list form: uneven chunks allowed (NCCL: grouped reduces)
all_to_all_single = dist.all_to_all_single
all_reduce = dist.all_reduce
