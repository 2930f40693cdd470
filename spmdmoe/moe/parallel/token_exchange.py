"""The SP layer's token exchange: the global token count ``T`` every SP rank agrees on, in one all-gather.

Legend: ``T`` global tokens of the SP input.

Made by gather mode (it gathers ``T`` rows), by sync-free EP on the SP axis (its capacity is sized from
``T``) and by a layer that carries the ride (``ride.py``: deferred problems and grad mode ride the same
exchange). One all-gather of ``1 + COLUMNS`` int64 per rank: ``(T, bad, ride columns...)``, in every
checking mode (with checks off nothing is found, so nobody reads it at once). Only a rank whose own input
was bad reads it on the host (a sync), and takes the ``T`` of the first rank whose input was good; when no
rank's was, the whole SP group stands in zero tokens (the problems are raised with everyone else's, at the
step boundary).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..._dist import all_gather_single
from ...agreement import Problem
from ...host import to_host
from ...types.mesh import MeshAxis
from ...types.placement import Shard
from ...types.tensor import SPMDTensor
from .ride import COLUMNS, Ride

__all__ = ["exchange_tokens"]


def exchange_tokens(x: Any, found: Problem, sp: MeshAxis, ride: Optional[Ride]) -> int:
    """The ``T`` every rank of ``sp`` gathers (module docstring). ``x``: this rank's input (its ``T`` counts
    only when it is sharded on ``sp``); ``found``: this rank's problems so far (their bits ride the exchange);
    ``ride``: the layer's ride, whose columns it fills and starts, or ``None``."""
    own = x.global_tokens if isinstance(x, SPMDTensor) and x.axis == sp and isinstance(x.placement, Shard) else -1
    width = 1 + COLUMNS
    mine = torch.full((width,), own, dtype=torch.int64, device=sp.metadata_device())  # fills: no host copy
    mine[1:2].fill_(found.bits)
    mine[2:].fill_(0)
    if ride is not None:
        ride.fill(mine[2:])
    table = torch.empty(sp.size * width, dtype=torch.int64, device=mine.device).view(sp.size, width)
    all_gather_single(table.view(-1), mine, group=sp.group)
    if ride is not None:
        ride.start(table[:, 1:])
    if not found:
        return own
    good = [row[0] for row in to_host(table) if not row[1]]
    return good[0] if good else 0
