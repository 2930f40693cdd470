"""The parallel layer (layer 8 of ``docs/design.md`` §0: imports ``moe.layer`` and everything below it).

======================  ========================================================================
``layer.py``            ``parallelize_moe`` and ``ParallelMoE``: the layer over SP / EP / DP axes
``plan.py``             the one-off agreement on config, plan and weights
``admission.py``        the seam between a forward's input and its data path
``accept.py``           the local, free check of one rank's input
``token_exchange.py``   the SP token count every rank agrees on, in one all-gather
``ride.py``             deferred problems and the grad mode riding that exchange
``gather_mode.py``      gather mode's rows: all-gathered over SP and reduce-scattered back
======================  ========================================================================
"""

from .layer import ParallelMoE, parallelize_moe

__all__ = ["ParallelMoE", "parallelize_moe"]
