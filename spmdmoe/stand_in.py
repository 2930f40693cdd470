"""The stand-in: what a rank whose input failed the agreed checks returns, part of the agreement mechanism
(``spmdmoe.agreement``).

A rank that finds a problem in its own input does not raise alone (its peers would wait in the next
collective). It runs the layer on zero rows (issuing exactly the collectives its peers issue), and returns
:func:`stand_in`: zeros shaped like its input, linked to its input and to the layer's output, so its backward
takes part in every collective too. The problem bits ride an exchange, and every rank raises the same error.

Legend: ``T`` rows, ``D`` model dim.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .types.tensor import SPMDTensor

__all__ = ["stand_in"]


class _StandIn(torch.autograd.Function):
    """Zeros shaped like ``like``; the backward sends zero gradients to ``like`` and to ``out_TD``.

    So a rank that stood in still runs every backward collective: the layer's
    own (through ``out_TD``) and those upstream of its input (through ``like``).
    Zeros, not ``0 * x``, so a non-finite input cannot turn them into NaN.
    """

    @staticmethod
    def forward(ctx: Any, like: torch.Tensor, out_TD: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.like = (like.shape, like.dtype, like.device)
        ctx.out = (out_TD.shape, out_TD.dtype, out_TD.device)
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        shape, dtype, device = ctx.like
        g_like = None if device.type == "meta" else torch.zeros(shape, dtype=dtype, device=device)
        shape, dtype, device = ctx.out
        return g_like, torch.zeros(shape, dtype=dtype, device=device)


def stand_in(x: Any, out_TD: torch.Tensor, zero_rows: Callable[[int], torch.Tensor]) -> Any:
    """What a rank with a bad input returns: zeros shaped like its input (its own code downstream sees
    what it passed), linked to its input and to the layer's output so its backward takes part in every
    collective its peers run. An input that cannot carry a gradient gets zero rows of the layer's width."""
    local = x.local if isinstance(x, SPMDTensor) else x
    if isinstance(local, torch.Tensor) and local.is_floating_point():
        zeros = _StandIn.apply(local, out_TD)
        return x.with_local(zeros) if isinstance(x, SPMDTensor) else zeros
    rows = local.shape[0] if isinstance(local, torch.Tensor) and local.dim() else 0
    return _StandIn.apply(zero_rows(rows), out_TD)
