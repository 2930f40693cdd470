"""Gather-mode SP (``parallelize_moe(sp_mode="gather")``): every SP rank routes all ``T`` tokens through its
slice of every expert's hidden units (tensor-parallel experts), then the partial outputs are summed back
onto each rank's own rows.

Legend: ``T`` tokens (the SP input's global rows once gathered; after the reduce-scatter, this rank's own),
``D`` model dim, ``F`` expert hidden dim (split over SP by the chunk rule).

Per forward: the token exchange (``admission.py``: the agreed ``T``), an all-gather of the ``T`` rows
(``Shard -> Replicate``: :meth:`GatheredRows.gather`), the route (route, dispatch, experts, combine) on all of
them with the load counted on this rank's own rows only, a reduce-scatter of the partial sums
(``Partial -> Shard``: :meth:`GatheredRows.scatter`), and the shared experts on this rank's own rows. The
backward: the all-gather's and reduce-scatter's reverses. A rank whose input was bad stands in its chunk of
zeros at the agreed ``T``, so every rank issues the same collectives.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...collectives import all_gather, reduce_scatter
from ...types import layout
from ...types.mesh import MeshAxis
from ...types.placement import Partial, Shard
from ...types.tensor import SPMDTensor
from ..layer import Admitted

__all__ = ["GatheredRows"]


class GatheredRows:
    """Gather mode's rows over ``sp`` (``layer.Rows``): every SP rank's rows to the router, this rank's rows
    of the summed output back."""

    def __init__(self, sp: MeshAxis):
        self.sp = sp

    def gather(self, x_TD: torch.Tensor, a: Admitted) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(h_TD, own_T)``: the SP group's ``T`` rows (this rank's ``x_TD`` is its chunk), and the mask of
        those this rank holds (its load counts, aux loss and non-finite check). The input itself is gathered
        where ``x_TD`` is its rows (not joined, not standing in): a padded buffer it carries is sent as it is."""
        T, sp = a.T, self.sp
        assert T is not None, "gather mode: the admission agrees on T"
        start = layout.chunk_offset(T, sp.size, sp.rank)
        x = a.x if isinstance(a.x, SPMDTensor) and a.x.local is x_TD else SPMDTensor._new(x_TD, sp, Shard(0), T, 0)
        h_TD = all_gather(x).local
        rows_T = torch.arange(h_TD.shape[0], device=h_TD.device)
        return h_TD, (rows_T >= start) & (rows_T < start + x_TD.shape[0])

    def scatter(self, out_TD: torch.Tensor, a: Admitted) -> torch.Tensor:
        """This rank's rows of the sum of every SP rank's partial ``out_TD`` (the reduce-scatter)."""
        assert a.T is not None, "gather mode: the admission agrees on T"
        return reduce_scatter(SPMDTensor._new(out_TD, self.sp, Partial(), a.T, 0)).local
