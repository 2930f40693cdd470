"""Mixture-of-Experts on typed tensors (docs/design.md §5).

=========================  =====================================================
``MoEConfig``              shapes and routing options
``MoE``                    the single-device layer, ``forward(x_TD) -> y_TD``
``parallelize_moe``        the same layer over SP (local / gather) and EP axes
``sync_grads``             views whose backward sums fresh gradients over an axis
``agree_grad_set``         agree now on which of its tensors need a gradient
``replicate_grads``        the same for a whole module's replicated parameters
``overlap_grads``          let those sums overlap backward until a module's input
``LocalTransport``         dispatch/combine with every expert local
``AllToAllTransport``      dispatch/combine over an EP axis (sync mode)
``RoutedTokens``           a transport's output: rows grouped by local expert
``grad_reductions``        per parameter: the group and divide factor its
                           gradient still needs across batches (DP)
``reduce_grads``           apply them by hand after ``backward``
``clip_grad_norm_``        clip by the global norm over every axis (one
                           all-reduce, the same coefficient on every rank)
``ddp``                    ``DistributedDataParallel`` applying them (comm hook)
``fully_shard_moe``        FSDP2 units on the right groups, torchtitan-style
``register_spmd_hooks``    let FSDP2 see a unit's ``SPMDTensor`` inputs/outputs
=========================  =====================================================
"""

from .training.clip import clip_grad_norm_
from .config import MoEConfig
from .transports.dispatch import AllToAllTransport, LocalTransport
from .training.data_parallel import ddp, grad_reductions, reduce_grads
from .training.fsdp import fully_shard_moe, register_spmd_hooks
from .params.grads import GradReduction, agree_grad_set, replicate_grads, sync_grads
from .layer import MoE
from .params.overlap import overlap_grads
from .parallel.layer import ParallelMoE, parallelize_moe
from .transports.routed import RoutedTokens
from .routing.router import Routing, route

__all__ = [
    "MoEConfig",
    "MoE",
    "ParallelMoE",
    "parallelize_moe",
    "sync_grads",
    "agree_grad_set",
    "replicate_grads",
    "overlap_grads",
    "GradReduction",
    "grad_reductions",
    "reduce_grads",
    "clip_grad_norm_",
    "ddp",
    "fully_shard_moe",
    "register_spmd_hooks",
    "LocalTransport",
    "AllToAllTransport",
    "RoutedTokens",
    "Routing",
    "route",
]
