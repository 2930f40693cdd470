"""What a parallel MoE layer accepts as input, checked locally and for free.

Legend: ``T`` this rank's rows, ``D`` model dim.

:func:`accept` compares one rank's input with the layer every rank agreed on (``plan.py``): ``Shard(0)`` on
the layer's SP axis (or, without SP, a plain ``(T, D)`` tensor or a ``Varying`` ``SPMDTensor``), width ``D``,
the layer's compute dtype and device. It never raises and never communicates: what it finds goes into a
:class:`spmdmoe.agreement.Problem`, and the admission then stands in zero rows (``spmdmoe.stand_in``) so that the
rank still issues every collective its peers issue; the problem bits ride the layer's next exchange.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...agreement import Problem, global_rank
from ...types.mesh import MeshAxis
from ...types.placement import Shard, Varying
from ...types.tensor import SPMDTensor

__all__ = ["accept"]


def accept(x: Any, found: Problem, *, sp: Optional[MeshAxis], ep: Optional[MeshAxis], dim: int, dtype: torch.dtype,
           device: torch.device) -> Optional[torch.Tensor]:
    """This rank's ``(T, D)`` rows if ``x`` is what the layer takes, else ``None`` with ``found`` set.

    ``sp`` / ``ep``: the layer's axes (``None``: none); ``dim``, ``dtype``, ``device``: its width, compute dtype
    and device. Messages name global ranks, as the layer's verdicts do."""
    axis = sp if sp is not None else ep
    rank = global_rank()
    if sp is not None:
        expected = "an SPMDTensor sharded with Shard(0) on the layer's sp_mesh"
        if not (isinstance(x, SPMDTensor) and isinstance(x.placement, Shard) and x.token_dim == 0):
            found.add("input_layout", f"rank {rank}: this MoE layer takes {expected}, found {_describe(x)}; "
                                      "wrap the local rows with spmdmoe.shard(...) or spmdmoe.from_local(...) (a "
                                      "DTensor through DTensorAdapter: flatten it to (tokens, dim), Shard(0))")
            return None
        if x.axis != sp:
            found.add("input_mesh", f"rank {rank}: the input is sharded on {x.axis}, but the layer's sp_mesh "
                                    f"is {sp}")
            return None
        x_TD = x.local
    else:
        if isinstance(x, SPMDTensor) and not isinstance(x.placement, Varying):
            found.add("input_layout", f"rank {rank}: without sp_mesh this MoE layer takes a plain (tokens, dim) "
                                      f"tensor or a Varying SPMDTensor, found {x.placement}; pass sp_mesh to "
                                      "parallelize_moe for SP inputs")
            return None
        if not isinstance(x, (SPMDTensor, torch.Tensor)):
            found.add("input_layout", f"rank {rank}: this MoE layer takes a (tokens, dim) tensor, found {_describe(x)}")
            return None
        x_TD = x.local if isinstance(x, SPMDTensor) else x
    if x_TD.dim() != 2 or x_TD.shape[1] != dim:
        found.add("width", f"rank {rank}: the MoE layer expects local rows of shape (tokens, dim={dim}), found "
                           f"{tuple(x_TD.shape)}; flatten the batch to (tokens, {dim}) before the layer")
    if x_TD.dtype != dtype:
        found.add("dtype", f"rank {rank}: the MoE layer computes in {dtype} (its parameters' dtype), found input "
                           f"of dtype {x_TD.dtype}; cast the input (x.to({dtype})) or the layer")
    if axis is not None and (problem := axis.device_problem(x_TD)) is not None:
        found.add("device", f"rank {rank}: input {problem}")
    elif x_TD.device != device:  # a device the backend takes, but not the layer's
        found.add("device", f"rank {rank}: input on {x_TD.device}, the layer on {device}; "
                            "move the input there with .to(...)")
    return None if found else x_TD


def _describe(x: Any) -> str:
    return f"{x.placement} on {x.axis}" if isinstance(x, SPMDTensor) else type(x).__name__
