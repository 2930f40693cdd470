"""The experts (layer 6 of ``docs/design.md`` §0: imports transports (``RoutedTokens``), routing, parameters and
the layers below).

==================  ==============================================================================
``grouped.py``      ``GroupedExperts`` (the routed experts, bf16 or FP8), ``SharedExperts``, their slices
``gemm.py``         the grouped GEMMs and the packed ``w1 | w3`` storage
``wgrad_later.py``  the up projection's weight gradients as a node of their own, under dx's exchange
``fp8.py``          the FP8 path's GEMMs (native or emulated) and weight layouts
``fp8_ops.py``      its custom ops, their fakes and autograd, and ``fp8_swiglu``
``fp8_cache.py``    the quantized weights, checked on the device before every use
==================  ==============================================================================
"""

from .grouped import GroupedExperts, SharedExperts

__all__ = ["GroupedExperts", "SharedExperts"]
