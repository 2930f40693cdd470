"""Gather-mode SP (``parallelize_moe(sp_mode="gather")``): every SP rank routes all ``T`` tokens through its
slice of every expert's hidden units (tensor-parallel experts), then the partial outputs are summed back
onto each rank's own rows.

Legend: ``T`` tokens (the SP input's global rows once gathered; after the reduce-scatter, this rank's own),
``D`` model dim, ``F`` expert hidden dim (split over SP by the chunk rule).

Per forward: the token exchange (``token_exchange.py``: the agreed ``T``), an all-gather of the ``T`` rows
(``Shard -> Replicate``), the layer's pipeline (route, dispatch, experts, combine) on all of them with the
load counted on this rank's own rows only, a reduce-scatter of the partial sums (``Partial -> Shard``), and
the shared experts on this rank's own rows. The backward: the all-gather's and reduce-scatter's reverses.
A rank whose input was bad stands in its chunk of zeros at the agreed ``T``, so every rank issues the same
collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from ..agreement import Found
from ..sticky import Problem
from ..collectives import all_gather, reduce_scatter
from ..types import layout
from ..types.placement import Partial, Shard
from ..types.tensor import SPMDTensor
from .sync_free import layer_t_max
from .token_exchange import exchange_tokens

__all__ = ["gather_input", "gathered"]


def gather_input(layer: Any, x: Any, found: Found) -> tuple[SPMDTensor, int]:
    """Gather mode's input and the ``T`` the SP axis agrees on: ``x``, or on a rank whose input is bad its
    chunk as zeros, at that ``T``."""
    sp = layer.sp
    T = exchange_tokens(x, found, sp, layer._ride)
    if found:
        x = SPMDTensor._new(layer._zero_rows(layout.local_tokens(T, sp.size, sp.rank)), sp, Shard(0), T, 0)
    assert isinstance(x, SPMDTensor)
    return x, T


def gathered(layer: Any, x: SPMDTensor, T: int, problem: Problem) -> torch.Tensor:
    """All SP rows through the layer's pipeline with this rank's expert slices, reduce-scattered back to this
    rank's rows, plus the shared experts on them (module docstring)."""
    sp = layer.sp
    w = layer.weights()
    start = layout.chunk_offset(T, sp.size, sp.rank)
    h_TD = all_gather(x).local
    rows_T = torch.arange(h_TD.shape[0], device=h_TD.device)
    own_T = (rows_T >= start) & (rows_T < start + x.local_tokens)
    # EP on another axis: max_tokens or the all-reduce; more rows than max_tokens (the whole SP group
    # sees the same T) is recorded with this forward's problems, for the step boundary
    over = Found()
    t_max = layer_t_max(layer, None, h_TD, over)
    if over:
        problem.bits, problem.details = problem.bits | over.bits, problem.details + over.details
    partial_TD, shared_TD = layer._pipeline(h_TD, w, layer.transport, own=own_T, problem=problem, t_max=t_max,
                                            shared_of=x.local)
    return layer._plus(reduce_scatter(SPMDTensor._new(partial_TD, sp, Partial(), T, 0)).local, shared_TD)
