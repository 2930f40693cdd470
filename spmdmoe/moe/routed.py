"""``RoutedTokens``: the dispatcher's output, rows grouped by local expert.

Legend: ``T`` tokens routed here, ``K`` top-k, ``R`` rows in the buffer (routed copies received by this
rank's experts), ``D`` model dim, ``e`` local experts.

A transport (``spmdmoe.moe.dispatch``, ``spmdmoe.moe.sync_free``) turns ``(x_TD, ids_TK)`` into a
``RoutedTokens`` and ``combine`` turns the experts' output rows back into the
source layout. The experts only ever see ``x_RD`` and ``group_offsets``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["RoutedTokens"]


@dataclass(frozen=True)
class RoutedTokens:
    """Expert-major rows for this rank's experts.

    Attributes:
        x_RD: the rows, grouped by local expert (expert 0's rows first), in the
            order of their source rank and, within a source, of the source's
            stable sort.
        group_offsets: int32 device tensor ``(e,)``: the end row of each local
            expert's group (the ``offs`` of ``torch.nn.functional.grouped_mm``).
            Device-resident, so a consumer never needs ``.item()``.
        capacity: the buffer's row count ``R`` (a host int). In sync mode it is
            exactly the number of valid rows.
        group_sizes: per-local-expert row counts on the host when the transport
            already paid for them (the all-to-all sync); ``None`` otherwise.
        handle: the transport's private state needed by ``combine``.
        valid_rows: a one-element int32 device tensor, the number of valid rows
            (rows ``[0, valid_rows)`` of ``x_RD``; the rest of a capacity-sized
            buffer may hold anything, NaN included). Defaults to the last group
            offset (a view, no copy). Consumers (SwiGLU, the grouped GEMM, the
            combine) never read a row past it, and read it only on the device.
        weights_R: the routing weight of each row (fp32, differentiable) when the transport folds the
            combine's weights into the experts (their SwiGLU multiplies its output row by it, and the
            combine sums unweighted); ``None``: the combine weights.
        fp8_rows: ``(q_RD, s_R)``, the rowwise e4m3 of ``x_RD`` and its fp32 scales, when the transport
            made them (asked to, and able to quantize once per token before its fan-out); ``None``: the
            FP8 experts quantize ``x_RD`` themselves.
        copies_TK: int64 ``(T, K)``, the row of each token's ``k``-th copy, when the combine is the
            unweighted sum of each token's copies (the weights folded into the experts): the experts then
            return ``y_TD``, that sum, themselves (the FP8 experts fuse it into their down-projection's
            autograd node; its backward fans each token's output gradient out and quantizes it once for
            its ``K`` copies) and the transport's combine passes it through. ``None``: the experts return
            ``y_RD``.
    """

    x_RD: torch.Tensor
    group_offsets: torch.Tensor
    capacity: int
    group_sizes: Optional[list[int]]
    handle: Any
    valid_rows: Optional[torch.Tensor] = None
    weights_R: Optional[torch.Tensor] = None
    fp8_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    copies_TK: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.valid_rows is None:
            object.__setattr__(self, "valid_rows", self.group_offsets[-1:])
