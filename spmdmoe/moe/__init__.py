"""Mixture-of-Experts on typed tensors (DESIGN.md §5).

=========================  =====================================================
``MoEConfig``              shapes and routing options
``MoE``                    the single-device layer, ``forward(x_TD) -> y_TD``
``parallelize_moe``        the same layer over SP (local / gather) and EP axes
``sync_grads``             views whose backward sums fresh gradients over an axis
``replicate_grads``        the same for a whole module's replicated parameters
``LocalTransport``         dispatch/combine with every expert local
``AllToAllTransport``      dispatch/combine over an EP axis (sync mode)
=========================  =====================================================
"""

from .config import MoEConfig
from .dispatch import AllToAllTransport, LocalTransport
from .grads import replicate_grads, sync_grads
from .layer import MoE
from .parallel import ParallelMoE, parallelize_moe
from .router import Routing, route

__all__ = [
    "MoEConfig",
    "MoE",
    "ParallelMoE",
    "parallelize_moe",
    "sync_grads",
    "replicate_grads",
    "LocalTransport",
    "AllToAllTransport",
    "Routing",
    "route",
]
