"""Token dispatch and combine: one small interface, one class per transport.

Legend: ``T`` tokens routed here, ``D`` model dim, ``K`` top-k, ``N = T*K``
routed copies, ``E`` experts, ``e`` local experts, ``n`` EP ranks, ``R`` rows
received by this rank's experts.

Interface (docs/design.md §5)::

    routed = transport.dispatch(x_TD, ids_TK, problem=code, capacity=cap,   # -> RoutedTokens
                                fp8_rows=..., weights_TK=w_TK)
    out_TD = transport.combine(y_RD, routed, weights_TK)

``fp8_rows`` and ``weights_TK`` are offers a transport may take: ``LocalTransport`` quantizes each token
once in its fan-out for FP8 experts (``RoutedTokens.fp8_rows``) and folds the routing weights into the
experts (``RoutedTokens.weights_R``); the combine is then the unweighted sum of each token's copies, which
the experts do themselves (``RoutedTokens.copies_TK``: the FP8 experts fuse it into their down-projection,
whose backward quantizes each token's output gradient once for its ``K`` copies) and ``combine`` passes
their token rows through. The EP transports ignore both offers.

``LocalTransport`` (no EP: every expert is local) and ``AllToAllTransport``
(EP, sync mode) share the sort and the gathers of ``permute.py``; which one a
layer uses follows from the meshes it was given and its ``ep_mode``
(``SyncFreeTransport``, ``sync_free.py``, the static-capacity one).
``capacity``: ``sync_free.Capacity`` (``T_max``, the most tokens any rank routes,
a host int the layer derives from its layout, and the layer's overflow buffer);
only the sync-free transport takes it.

``problem``: this rank's problem bits for the forward (``spmdmoe.agreement``:
a bad input, non-finite router logits). ``AllToAllTransport`` carries them in
its count exchange (mode (a)): when its EP axis spans every rank the layer
talks to, every rank raises right there; otherwise each rank records its own
bits in the sticky flag (mode (c)) and the step goes on, so that no rank
leaves a peer waiting, and the step boundary raises everywhere. Under
``torch.compile`` a graph cannot branch on the exchanged bits: every rank
records its own (mode (c)) and the step boundary raises.
``LocalTransport`` has no exchange: it records (mode (c)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..agreement import GRAD_OFF, Problem, grad_mode_codes, raise_problems
from ..collectives.alltoall import exchange_split_sizes, exchanged_op
from ..types.mesh import MeshAxis
from .routed import RoutedTokens
from .permute import scatter_rows, scatter_rows_fp8, sort_by_expert, spread_weights, weighted_combine

__all__ = ["LocalTransport", "AllToAllTransport"]


def _fan_out(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_ND, counts_E, pos_TK)``: the ``N`` routed copies in stable expert order, the copies per
    expert, and where copy ``(t, k)`` sits."""
    pos_TK, counts_E = sort_by_expert(ids_TK, num_experts)
    return scatter_rows(x_TD, pos_TK), counts_E, pos_TK


class LocalTransport:
    """Every expert lives on this rank: sort, group, and un-sort. No communication, no sync.

    ``problem`` bits are recorded in the layer's sticky flag (``spmdmoe.agreement.ProblemFlag``).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, *, problem: Optional[Problem] = None,
                 capacity: Any = None, fp8_rows: bool = False, weights_TK: Optional[torch.Tensor] = None
                 ) -> RoutedTokens:
        """``fp8_rows``: also the rowwise e4m3 of the copies, quantized once per token in the fan-out's pass
        (``RoutedTokens.fp8_rows``, for FP8 experts). ``weights_TK``: the routing weights, folded into the
        experts (``RoutedTokens.weights_R``); the experts then sum each token's copies themselves
        (``RoutedTokens.copies_TK``) and :meth:`combine` passes their ``y_TD`` through."""
        if problem is not None:
            problem.record(problem.bits, x_TD.device)
        pos_TK, counts_E = sort_by_expert(ids_TK, self.num_experts)
        q = None
        if fp8_rows:
            x_ND, q_ND, s_N = scatter_rows_fp8(x_TD, pos_TK)
            q = (q_ND, s_N)
        else:
            x_ND = scatter_rows(x_TD, pos_TK)
        w_N = spread_weights(weights_TK, pos_TK, x_ND.shape[0]) if weights_TK is not None else None
        return RoutedTokens(x_ND, counts_E.cumsum(0).to(torch.int32), x_ND.shape[0], None, pos_TK,
                            weights_R=w_N, fp8_rows=q, copies_TK=pos_TK if w_N is not None else None)

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's copies; with the weights folded into the experts, ``y_RD`` is
        already their ``y_TD`` (the unweighted sum, done by the experts: ``RoutedTokens.copies_TK``)."""
        if routed.copies_TK is not None:
            return y_RD
        return weighted_combine(y_RD, routed.handle, weights_TK if routed.weights_R is None else None)


@dataclass(frozen=True)
class _Exchange:
    pos_TK: torch.Tensor  # where each routed copy sits in the send buffer
    send: list[int]  # rows to each EP rank
    recv: list[int]  # rows from each EP rank
    perm_R: torch.Tensor  # expert-major row r reads source-major row perm_R[r]
    inv_R: torch.Tensor  # its inverse


class AllToAllTransport:
    """Expert parallel over ``axis``: experts are contiguous blocks of ``e = E / n`` per rank.

    Dispatch: stable sort by expert (so rows are grouped by destination too),
    exchange the ``(n, e)`` counts and every rank's problem bits with one
    ``all_to_all_single`` plus ONE explicit host transfer (the documented sync
    of sync mode, counted by ``spmdmoe.host.host_sync_count``),
    ``all_to_all_single`` of the rows, then a device gather from source-major
    to expert-major order. ``raises``: whether a problem reported by any rank
    raises at the exchange (the axis spans every rank the layer talks to) or is
    recorded for the step boundary (see the module docstring).
    Combine: the inverse gather, the reverse all-to-all, and the weighted
    gather-sum over the K copies. Backward: the same moves reversed (gathers,
    never scatter-adds). Zero rows anywhere are fine.
    """

    def __init__(self, axis: MeshAxis, num_experts: int, raises: bool = True):
        self.axis = axis
        self.num_experts = num_experts
        self.local_experts = num_experts // axis.size
        self.raises = raises

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, *, problem: Optional[Problem] = None,
                 capacity: Any = None, fp8_rows: bool = False, weights_TK: Optional[torch.Tensor] = None
                 ) -> RoutedTokens:
        """``fp8_rows``, ``weights_TK``: ignored (the rows travel in their own dtype, FP8 experts quantize
        what arrives; the combine weights the rows that come back)."""
        problem = problem or Problem()
        n, e = self.axis.size, self.local_experts
        x_ND, counts_E, pos_TK = _fan_out(x_TD, ids_TK, self.num_experts)
        counts = counts_E.view(n, e).to(self.axis.metadata_device())
        marker = 0 if torch.is_grad_enabled() else GRAD_OFF  # grad mode rides too: a mix would hang backward
        send, recv, sizes, codes, recv_ne = exchange_split_sizes(counts, problem.bits | marker, self.axis)
        if torch.compiler.is_compiling():  # no data-dependent raise in a graph: the step boundary raises
            problem.record(problem.bits, x_TD.device)
        elif any(codes := grad_mode_codes(codes)):
            mine = codes[self.axis.rank]
            if self.raises:
                raise_problems("MoE dispatch", codes, problem.details if mine else [], ranks=self.axis.ranks)
            problem.record(mine, x_TD.device)
        if torch.compiler.is_compiling():  # facts about the traced counts that the tracer cannot see
            for c in send + recv + sizes:
                torch._check(c >= 0)
            torch._check(sum(send) == x_ND.shape[0])
            torch._check(sum(sizes) == sum(recv))
        x_recv = exchanged_op(x_ND, send, recv, self.axis, 0)
        R = sum(recv)
        perm_R, offsets = _expert_major(recv_ne.to(x_ND.device), R)
        inv_R = torch.empty_like(perm_R)
        inv_R.scatter_(0, perm_R, torch.arange(R, device=perm_R.device))
        x_RD = scatter_rows(x_recv, inv_R.view(R, 1))
        return RoutedTokens(x_RD, offsets, R, sizes, _Exchange(pos_TK, send, recv, perm_R, inv_R))

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        ex: _Exchange = routed.handle
        y_recv = scatter_rows(y_RD, ex.perm_R.view(-1, 1))
        y_ND = exchanged_op(y_recv, ex.recv, ex.send, self.axis, 0)
        return weighted_combine(y_ND, ex.pos_TK, weights_TK)


def _expert_major(recv_ne: torch.Tensor, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From the received ``(n, e)`` counts on the device: the gather index from source-major
    ``(src, expert)`` blocks to expert-major ``(expert, src)`` blocks (``perm_R[r]``: the received row
    that expert-major row ``r`` reads) and the int32 group offsets. Device work only: no host sync,
    no host-to-device copy (``R``, the received row count, is already on the host)."""
    n, e = recv_ne.shape
    lengths_ne = recv_ne.to(torch.int64)
    src_start_ne = lengths_ne.reshape(-1).cumsum(0).view(n, e) - lengths_ne
    lengths_en = lengths_ne.t().reshape(-1)
    dst_start_en = lengths_en.cumsum(0) - lengths_en
    shift_en = src_start_ne.t().reshape(-1) - dst_start_en
    segment_R = torch.repeat_interleave(shift_en, lengths_en, output_size=R)
    perm_R = torch.arange(R, device=recv_ne.device) + segment_R
    return perm_R, lengths_ne.sum(0).cumsum(0).to(torch.int32)
