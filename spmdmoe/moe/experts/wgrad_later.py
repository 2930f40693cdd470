"""The up-projection's weight gradients made later in the backward than its input gradient (dgrad / wgrad split).

Legend: ``M`` rows, ``I`` input (reduction) dim, ``F`` the experts' hidden dim (``h13`` is ``2F`` wide), ``e``
local experts.

Why: on an EP layer over an all-to-all transport, the input gradient of the routed experts (their rows'
``dx``) goes back to the ranks it came from by an exchange that the dispatch's wait node launches in the
backward (``collectives.alltoall.exchange_launched``). With one node making ``dx``, ``dw1`` and ``dw3``
together, that exchange starts only after the two weight-gradient GEMMs. Split, the up-projection's node
makes ``dx`` and hands its operands (the output gradient, the rows, the offsets) to an *anchor*: a node on
``w1`` and ``w3`` made in the forward between the dispatch's launch and its wait
(``_Layer._dispatch``). Autograd runs the ready node made last first, so the backward runs: the experts'
input gradient, the fan-out's backward, the wait's node (launches ``dx``'s exchange), the shared experts'
backward, the anchor (``dw1``, ``dw3``: two grouped GEMMs, a third of the experts' backward FLOPs), then the
launch's node, which waits for the exchange. The GEMMs are the same on the same operands: the gradients are
bit for bit those of one node.

Only where it pays and is exact and cheap to prove so: a transport whose backward exchange is in flight
between two nodes (``Dispatching.backward_in_flight``: the all-to-all ones); experts not in FP8 whose ``w1``
and ``w3`` are plain, packed parameters (``gemm.joined``) read as they are (``GroupedExperts.later_wgrad``), not
summed over an SP axis here (``grad_axis``: the sum's node would need the gradients first), in eager mode
(under ``torch.compile`` inductor schedules the backward itself). FSDP2's unpacked experts keep one node: FSDP2
reduce-scatters a unit's gradients when its input gradient is done. A backward that reaches the up-projection
but not the weights (``torch.autograd.grad`` of the input alone) leaves the operands held until the graph is
freed, where one node would have freed them with its saved tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from .gemm import up_weight_grads

__all__ = ["LaterWgrad"]


class LaterWgrad:
    """The anchor of one forward's up-projection: ``token`` (an empty tensor, on the anchor's node) goes into
    the up-projection (``gemm.grouped_mm_pair(..., later=...)``), whose backward :meth:`hold` s its operands
    and returns ``dx`` only; the anchor's backward makes ``dw1`` and ``dw3`` from them. (The anchor's node
    keeps only the list the operands go into, not this object: no reference cycle through the graph.)"""

    def __init__(self, w1_eFI: torch.Tensor, w3_eFI: torch.Tensor):
        self.held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.token: torch.Tensor = _Anchor.apply(self.held, w1_eFI, w3_eFI)

    def hold(self, g_M2F: torch.Tensor, x_MI: torch.Tensor, offsets_e: torch.Tensor) -> torch.Tensor:
        """Keep the operands for the anchor; returns the token's (empty) gradient."""
        self.held[:] = [(g_M2F, x_MI, offsets_e)]
        return torch.zeros_like(self.token)


class _Anchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, held: list, w1_eFI: torch.Tensor, w3_eFI: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.held = held
        return w1_eFI.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, _: torch.Tensor) -> Any:  # type: ignore[override]
        if not ctx.held:  # the up-projection's backward did not run (nothing reached it)
            return None, None, None
        operands = ctx.held.pop()
        return (None, *up_weight_grads(*operands, needs=ctx.needs_input_grad[1:3]))
