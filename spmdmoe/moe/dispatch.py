"""Token dispatch and combine: one interface (:class:`Transport`), one class per transport.

Legend: ``T`` tokens routed here, ``D`` model dim, ``K`` top-k, ``N = T*K``
routed copies, ``E`` experts, ``e`` local experts, ``n`` EP ranks, ``R`` rows
received by this rank's experts, ``S`` rows of one sync-free (source, destination) slot.

=====================  ============================  ====================================  ==========
transport              a layer with                  collectives per forward (over EP)     host syncs
=====================  ============================  ====================================  ==========
``LocalTransport``     no EP (or an EP axis of 1)    none                                  none
``AllToAllTransport``  EP, ``ep_mode="sync"``        counts and problem bits all-to-all,   1
                                                     rows all-to-all (exact sizes)
``SyncFreeTransport``  EP, ``ep_mode="sync_free"``   counts all-gather, rows all-to-all    none
(``sync_free.py``)                                   (``S`` rows per rank pair)
=====================  ============================  ====================================  ==========

:func:`transport_for` makes the one a layer uses. All three sort the copies by
expert (``permute.sort_by_expert``); the EP ones turn the rows they receive
(source-major) into the experts' order (expert-major) with one index builder,
``permute.expert_major``. Backward: the same moves reversed, on every rank alike.

``problem`` (``spmdmoe.sticky``): ``AllToAllTransport`` carries the bits in
its count exchange (mode (a)): when its EP axis spans every rank the layer
talks to, every rank raises right there; otherwise each rank records its own
bits in the sticky flag (mode (c)) and the step goes on, so that no rank
leaves a peer waiting, and the step boundary raises everywhere. Under
``torch.compile`` a graph cannot branch on the exchanged bits: every rank
records its own (mode (c)). The others have no exchange of bits: they record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from ..agreement import GRAD_OFF, grad_mode_codes, raise_problems
from ..collectives.alltoall import exchange_split_sizes, exchanged_op
from ..sticky import Problem
from ..types.mesh import MeshAxis
from .routed import RoutedTokens
from .sync_free import SyncFreeTransport
from .permute import expert_major, scatter_rows, scatter_rows_fp8, sort_by_expert, spread_weights, weighted_combine

__all__ = ["Transport", "LocalTransport", "AllToAllTransport", "transport_for"]


class Transport(Protocol):
    """Moves each routed copy to the rank of its expert and the experts' output rows back (the module table).

    Each method's docstring states every argument's shape, dtype and meaning, as DeepEP's ``Buffer.dispatch``
    / ``combine`` do.
    """

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, *, problem: Optional[Problem] = None,
                 capacity: Any = None, fp8_rows: bool = False, weights_TK: Optional[torch.Tensor] = None
                 ) -> RoutedTokens:
        """Send the ``K`` copies of each row to their experts; return the rows this rank's experts receive.

        Args:
            x_TD: ``(T, D)``, the layer's compute dtype (bf16 / fp32): the rows this rank routed. ``T`` may
                be 0 and may differ between ranks; the collectives are the same on every rank whatever it is.
            ids_TK: int64 ``(T, K)``: the global expert id (``0 <= id < E``) of each row's ``k``-th copy;
                a row's ``K`` ids are distinct.
            problem: this rank's problem bits of this forward (a bad input, non-finite logits) and the
                layer's sticky flag (``spmdmoe.sticky.Problem``); carried or recorded, never dropped.
                ``None``: no problem.
            capacity: ``sync_free.Capacity`` (``T_max``, a host int the same on every rank of the EP
                group, and the layer's int64 ``(4,)`` overflow buffer); required by ``SyncFreeTransport``,
                ignored by the others.
            fp8_rows: an offer: also the rowwise e4m3 of the rows the experts receive, quantized once per
                token before the fan-out (``RoutedTokens.fp8_rows``). Taken by ``LocalTransport`` only.
            weights_TK: an offer: fp32 ``(T, K)`` routing weights (differentiable) to fold into the experts
                (``RoutedTokens.weights_R``, ``copies_TK``; the experts then sum each token's copies and
                :meth:`combine` passes their ``y_TD`` through). Taken by ``LocalTransport`` only.

        Returns: ``RoutedTokens``: ``x_RD`` ``(R, D)`` in ``x_TD``'s dtype, grouped by local expert
        (expert 0 first; within an expert by source rank, then by the source's stable sort); int32
        ``group_offsets`` ``(e,)`` on the device; ``capacity`` ``R`` (host int; the sync-free buffer's
        rows, of which the device ``valid_rows`` hold data); ``group_sizes`` on the host when the
        transport read them; the handle :meth:`combine` needs. Differentiable with respect to ``x_TD``
        (and ``weights_TK`` when taken); the backward runs the reverse collectives.
        """
        ...

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        """Return the experts' rows to their tokens: ``out[t] = sum_k weights_TK[t, k] * y[copy (t, k)]``.

        Args:
            y_RD: ``(R, D)``: the experts' output for ``routed.x_RD``, row for row (``(T, D)`` when
                ``routed.copies_TK`` is set: the experts summed each token's weighted copies already).
            routed: what :meth:`dispatch` returned in this forward.
            weights_TK: fp32 ``(T, K)``, the routing weights given to :meth:`dispatch` (differentiable).

        Returns ``(T, D)`` in ``y_RD``'s dtype (fp32 products and sum, rounded once). Backward: the
        output gradient fanned out to the copies with the weights, the weights' gradient each copy's row
        dotted with it; the reverse collectives.
        """
        ...


def _fan_out(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_ND, counts_E, pos_TK)``: the ``N`` routed copies in stable expert order, the copies per
    expert, and where copy ``(t, k)`` sits."""
    pos_TK, counts_E = sort_by_expert(ids_TK, num_experts)
    return scatter_rows(x_TD, pos_TK), counts_E, pos_TK


class LocalTransport:
    """Every expert lives on this rank: sort, group, and un-sort. No communication, no sync.

    ``problem`` bits are recorded in the layer's sticky flag (``spmdmoe.sticky.ProblemFlag``).
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
    read_R: torch.Tensor  # expert-major row r reads received row read_R[r] (permute.expert_major)
    write_R: torch.Tensor  # its inverse: received row j is expert-major row write_R[j]


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
        read_R, write_R, offsets = expert_major(recv_ne.to(x_ND.device), R)
        x_RD = scatter_rows(x_recv, write_R.view(R, 1))
        return RoutedTokens(x_RD, offsets, R, sizes, _Exchange(pos_TK, send, recv, read_R, write_R))

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        ex: _Exchange = routed.handle
        y_recv = scatter_rows(y_RD, ex.read_R.view(-1, 1))
        y_ND = exchanged_op(y_recv, ex.recv, ex.send, self.axis, 0)
        return weighted_combine(y_ND, ex.pos_TK, weights_TK)


def transport_for(ep: Optional[MeshAxis], ep_mode: str, num_experts: int, top_k: int,
                  capacity_factor: Optional[float], raises: bool) -> Transport:
    """The transport of a layer with experts split over ``ep`` (``None``: all local) in ``ep_mode``
    (``"sync"`` or ``"sync_free"``; the module table). ``raises``: whether the sync transport raises the
    problems its count exchange carries (its axis spans every rank the layer talks to)."""
    if ep is None or ep.size == 1:
        return LocalTransport(num_experts)
    makers = {"sync": lambda: AllToAllTransport(ep, num_experts, raises=raises),
              "sync_free": lambda: SyncFreeTransport(ep, num_experts, top_k, capacity_factor)}
    return makers[ep_mode]()
