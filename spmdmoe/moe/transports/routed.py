"""``RoutedTokens``: the dispatcher's output, rows grouped by local expert.

Legend: ``T`` tokens routed here, ``K`` top-k, ``R`` rows in the buffer (routed copies received by this
rank's experts), ``D`` model dim, ``e`` local experts.

A transport (``dispatch.py``, ``sync_free.py``) turns ``(x_TD, ids_TK)`` into a ``RoutedTokens`` and ``combine`` turns
the experts' output rows back into the source layout. The experts only ever see ``x_RD`` and ``group_offsets``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..routing.permute import scatter_rows, scatter_rows_fp8, spread_weights

__all__ = ["RoutedTokens", "routed_copies", "Dispatching"]


@dataclass(frozen=True)
class RoutedTokens:
    """Expert-major rows for this rank's experts.

    Attributes:
        x_RD: the rows, grouped by local expert (expert 0's rows first), then by source rank, then by token.
        group_offsets: int32 device tensor ``(e,)``: the end row of each local expert's group (the ``offs`` of
            ``torch.nn.functional.grouped_mm``). Device-resident, so a consumer never needs ``.item()``.
        capacity: the buffer's row count ``R`` (a host int). In sync mode it is exactly the number of valid rows.
        group_sizes: per-local-expert row counts on the host when the transport already paid for them (the all-to-all
            sync); ``None`` otherwise.
        handle: the transport's private state needed by ``combine``.
        valid_rows: a one-element int32 device tensor, the number of valid rows (rows ``[0, valid_rows)`` of ``x_RD``;
            the rest of a capacity-sized buffer may hold anything, NaN included). Defaults to the last group offset (a
            view). Consumers (SwiGLU, the grouped GEMM, the combine) read no row past it, and read it only on device.
        weights_R: the routing weight of each row (fp32, differentiable) when the transport folds the combine's weights
            into the experts (their SwiGLU multiplies its output row by it, and the combine sums unweighted); ``None``:
            the combine weights.
        fp8_rows: ``(q_RD, s_R)``, the rowwise e4m3 of ``x_RD`` and its fp32 scales, when the transport made them (asked
            to, and able to quantize once per token before its fan-out); ``None``: the FP8 experts quantize ``x_RD``.
        copies_TK: int64 ``(T, K)``, the row of each (received) token's ``k``-th copy here (``-1``: another rank's
            expert), when the weights are folded into the experts (every transport's dispatch, ``routed_copies``): the
            experts then return ``y_TD``, each token's sum (the FP8 experts fuse it into their down-projection's
            autograd node, whose backward fans each token's output gradient out and quantizes it once for its copies),
            which the combine sends back to the token's rank. ``None``: the experts return ``y_RD``.
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


def routed_copies(x_MD: torch.Tensor, order: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weights_MJ: torch.Tensor,
                  rows: int, *, fp8_rows: bool = False, group_sizes: Optional[list[int]] = None, handle: Any = None
                  ) -> RoutedTokens:
    """The copies of ``M`` rows for this rank's experts, in expert-major order, with the routing weights folded
    into the experts (they return each row's weighted sum of its copies: ``copies_TK``). Every transport ends
    its dispatch here, on its own tokens or on the rows it received (a token once per rank, with all its ids).

    Args:
        x_MD: ``(M, D)``, the rows (bf16 / fp32); ``M`` may be 0.
        order: :func:`spmdmoe.kernels.expert_order` of the rows' ids into ``rows``: copy ``(s, j)``'s row (int64;
            ``-1``: none here, or dropped past ``rows``), the int32 group ends (and the counts, unused here).
        weights_MJ: fp32 ``(M, J)`` routing weights (differentiable); those of copies not here are unused.
        rows: host int, the experts' buffer rows: the copies' exact count, or a static capacity (rows past
            ``valid_rows`` never read; fewer than the copies: ``order`` dropped the rest, the transport records it).
        fp8_rows: also the rowwise e4m3 of the copies, quantized once per row (``RoutedTokens.fp8_rows``).
        group_sizes, handle: what the transport knows on the host and needs in its combine.

    No host sync."""
    pos_MJ, offsets, _ = order
    q = None
    if fp8_rows:
        x_RD, q_RD, s_R = scatter_rows_fp8(x_MD, pos_MJ, rows)
        q = (q_RD, s_R)
    else:
        x_RD = scatter_rows(x_MD, pos_MJ, rows)
    weights_R = spread_weights(weights_MJ, pos_MJ, rows)
    return RoutedTokens(x_RD, offsets, rows, group_sizes, handle, weights_R=weights_R,
                        fp8_rows=q, copies_TK=pos_MJ)


class Dispatching(torch.nn.Module, ABC):
    """The transports' base (``spmdmoe.moe.transports.dispatch.Transport``): each defines :meth:`launch_dispatch` and
    :meth:`launch_combine`, which start a move and return its wait; :meth:`dispatch` and :meth:`combine` are the two at
    once. A module, so that the state a transport owns (the sync-free ones' overflow buffer) follows its layer's
    ``.to()`` and meta init and keeps one address for CUDA graphs; it has no parameters and no ``forward``."""

    # whether the dispatch's backward launches its exchange in one autograd node and waits in another, with
    # what autograd runs between them under it (the all-to-all transports): the layer then has the experts'
    # weight gradients made there (``wgrad_later.py``)
    backward_in_flight: bool = False

    @abstractmethod
    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, **options: Any
                        ) -> Callable[[], RoutedTokens]:
        """``spmdmoe.moe.transports.dispatch.Transport.launch_dispatch`` (``SizedTransport``'s: with ``t_max``)."""

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, **options: Any
                 ) -> RoutedTokens:
        """:meth:`Transport.dispatch`."""
        return self.launch_dispatch(x_TD, ids_TK, weights_TK, **options)()

    @abstractmethod
    def launch_combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> Callable[[], torch.Tensor]:
        """``spmdmoe.moe.transports.dispatch.Transport.launch_combine``."""

    def combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> torch.Tensor:
        """:meth:`Transport.combine`."""
        return self.launch_combine(y_QD, routed)()
