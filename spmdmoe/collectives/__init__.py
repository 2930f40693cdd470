"""Differentiable collectives over ``SPMDTensor`` (docs/design.md §4).

=====================  ==========================  ===============================
op                     forward                     backward
=====================  ==========================  ===============================
``all_gather``         Shard -> Replicate          reduce_scatter (sum) -> Shard
``reduce_scatter``     Partial -> Shard            all_gather
``all_reduce``         Partial -> Replicate        all_reduce (sum)
``redistribute``       table of transitions        composed
``all_to_all``         Varying -> Varying          reverse all_to_all
=====================  ==========================  ===============================

Token counts come from the input's type, never from ``local.shape * world``;
padding happens only inside these ops, only on ranks that need it, at the tail.
"""

from ..host import host_sync_count
from .allreduce import all_reduce
from .alltoall import all_to_all, exchange_counts
from .gather_scatter import all_gather, reduce_scatter
from .transitions import TRANSITIONS, redistribute

__all__ = [
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "redistribute",
    "all_to_all",
    "exchange_counts",
    "host_sync_count",
    "TRANSITIONS",
]
