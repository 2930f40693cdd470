"""Token dispatch and combine: one interface (:class:`Transport`), one class per transport.

Legend: ``T`` tokens routed here, ``D`` model dim, ``K`` top-k, ``E`` experts,
``e`` local experts, ``n`` EP ranks, ``Q`` rows received (a token once per rank),
``R`` rows of this rank's experts (their copies), ``S`` rows of one sync-free (source, destination) slot.

=====================  ============================  ========================================  ==========
transport              a layer with                  collectives per forward (over EP)         host syncs
=====================  ============================  ========================================  ==========
``LocalTransport``     no EP (or an EP axis of 1)    none                                      none
``AllToAllTransport``  EP, ``ep_mode="sync"``        counts and problem bits all-to-all; rows  1
                                                     with their ids and weights all-to-all
                                                     (exact sizes); the combine's rows back
``SyncFreeTransport``  EP, ``ep_mode="sync_free"``   counts all-gather; the same two           none
(``sync_free.py``)     (gloo, several hosts)         all-to-alls, ``S`` rows per rank pair
``SymmetricTransport`` EP, ``ep_mode="sync_free"``   no NCCL: ids, then rows read from the     none
(``symmetric.py``)     (NCCL, one host)              peers' symmetric buffers (only the rows
                                                     that cross), between bounded barriers
=====================  ============================  ========================================  ==========

:func:`transport_for` makes the one a layer uses; every one ends its dispatch in ``routed.routed_copies`` and its
backward makes the same moves reversed. ``problem`` (``spmdmoe.agreement.Problem``): ``AllToAllTransport`` carries
the bits in its count exchange (mode (a); under ``torch.compile`` it records them, mode (c)), the others record them
in the sticky flag (mode (c)). The shared route: ``docs/design.md`` §5 (data flow, step 3); the problem modes: §6.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Union

import torch

from ...agreement import GRAD_OFF, Problem, ProblemSink, grad_mode_codes, problems_error, raise_if
from ...collectives.alltoall import exchange_split_sizes
from ...kernels import expert_order
from ...types.mesh import MeshAxis
from .dedup import Sent, SentBack, destinations, launch_tokens, send_positions
from ..routing.permute import count_per_expert, weighted_combine
from .routed import Dispatching, RoutedTokens, routed_copies
from .symmetric import SymmetricTransport, symmetric_usable
from .sync_free import SyncFreeTransport

__all__ = ["Transport", "SizedTransport", "LocalTransport", "AllToAllTransport", "transport_for"]


class Transport(Protocol):
    """Moves each token to the ranks of its experts and the experts' output rows back (the module table).

    Each method's docstring states every argument's shape, dtype and meaning, as DeepEP's ``Buffer.dispatch``
    / ``combine`` do.
    """

    # whether the dispatch's backward exchange is in flight between two autograd nodes (``routed.Dispatching``)
    backward_in_flight: bool

    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                        problem: Optional[Problem] = None, fp8_rows: bool = False) -> Callable[[], RoutedTokens]:
        """Send each row to the ranks of its ``K`` experts, started now: the call it returns waits for the rows
        and gives the copies this rank's experts receive. Work issued in between runs while the rows travel;
        :meth:`dispatch` is the two at once.

        Args:
            x_TD: ``(T, D)``, the layer's compute dtype (bf16 / fp32): the rows this rank routed. ``T`` may
                be 0 and may differ between ranks; the collectives are the same on every rank whatever it is.
            ids_TK: int64 ``(T, K)``: the global expert id (``0 <= id < E``) of each row's ``k``-th copy;
                a row's ``K`` ids are distinct.
            weights_TK: fp32 ``(T, K)`` routing weights (differentiable), folded into the experts
                (``RoutedTokens.weights_R``): they return each received row's weighted sum of its copies.
            problem: this rank's problem bits of this forward (a bad input, non-finite logits) and the
                layer's sticky flag (``spmdmoe.agreement.Problem``); carried or recorded, never dropped.
                ``None``: no problem.
            fp8_rows: also the rowwise e4m3 of the experts' rows, quantized once per row before the fan-out
                to the local experts (``RoutedTokens.fp8_rows``).

        Returns (from the call): ``RoutedTokens`` (``routed.routed_copies``): ``x_RD`` ``(R, D)`` in ``x_TD``'s dtype,
        grouped by local expert (expert 0 first; within an expert by source rank, then by token); int32
        ``group_offsets`` ``(e,)`` on the device; ``capacity`` ``R`` (host int; a sync-free buffer's rows,
        of which the device ``valid_rows`` hold data); ``group_sizes`` on the host when the transport read
        them; ``weights_R``, ``copies_TK`` (the received rows' copies); the handle :meth:`combine` needs.
        Differentiable with respect to ``x_TD`` and ``weights_TK``; the backward runs the reverse
        collectives. The returned call must be made once, on every rank, before the next collective of the
        transport's group.
        """
        ...

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                 problem: Optional[Problem] = None, fp8_rows: bool = False) -> RoutedTokens:
        """:meth:`launch_dispatch` and its wait, nothing in between."""
        ...

    def launch_combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> Callable[[], torch.Tensor]:
        """Return the experts' rows to their tokens, started now: the call it returns waits and gives
        ``out[t] = sum_k weights_TK[t, k] * y[copy (t, k)]``. Work issued in between (the shared experts) runs
        while the rows travel, and its backward while their gradient does.

        Args:
            y_QD: ``(Q, D)``: what the experts returned for ``routed`` (each received row's weighted sum of
                its copies; ``Q = T`` for the local transport).
            routed: what the dispatch returned in this forward.

        Returns (from the call) ``(T, D)`` in ``y_QD``'s dtype: a token's rows summed over the ranks it visited
        in fp32, rounded once. Backward: the output gradient back to each visited rank; the reverse
        collectives, launched where the gradient reaches the wait's node and waited for at the launch's. The
        returned call must be made once, on every rank, before the next collective of the transport's group.
        """
        ...

    def combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> torch.Tensor:
        """:meth:`launch_combine` and its wait, nothing in between (the all-to-all transports: one exchange
        waited for at once, no launch and wait nodes in the backward)."""
        ...


class SizedTransport(Transport, Protocol):
    """A transport of static sizes, fixed before any data is seen (``ep_mode="sync_free"``: ``SyncFreeTransport``,
    ``SymmetricTransport``): :class:`Transport`'s moves, with the most rows any rank of the EP group routes in
    this forward given to the dispatch, and an overflow buffer of its own.

    Attributes:
        overflow: int64 ``(4,)`` on the layer's device (a buffer of the transport module: it follows the layer's
            ``.to()`` and meta init and keeps one address for CUDA graphs, across ``set_ep_mode`` switches too):
            the worst demand since the last check (the excess in thousandths of balanced traffic, the slot rows
            and the experts' rows needed, ``T_max``); the same on every rank of the EP group.
    """

    overflow: torch.Tensor

    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *, t_max: int,
                        problem: Optional[Problem] = None, fp8_rows: bool = False) -> Callable[[], RoutedTokens]:
        """:meth:`Transport.launch_dispatch`, sized by ``t_max`` (a host int, the same on every rank of the EP
        group: the most rows any of them routes; ``x_TD`` has at most ``t_max`` rows unless a rank recorded
        that problem), with this forward's worst demand kept in :attr:`overflow` on the device."""
        ...

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *, t_max: int,
                 problem: Optional[Problem] = None, fp8_rows: bool = False) -> RoutedTokens:
        """:meth:`launch_dispatch` and its wait, nothing in between."""
        ...

    def record_overflow(self, flag: ProblemSink, layer: str) -> None:
        """Record what overflowed since the last check as a ``capacity`` problem in ``flag`` (the layer's sticky
        flag; ``layer`` names the layer in the message), for the step boundary to raise on every rank. One host
        read; :attr:`overflow` then starts afresh."""
        ...


class LocalTransport(Dispatching):
    """Every expert lives on this rank: sort, group, and un-sort. No communication, no sync.

    ``problem`` bits are recorded in the layer's sticky flag (``spmdmoe.sticky.ProblemFlag``).
    """

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                        problem: Optional[Problem] = None, fp8_rows: bool = False) -> Callable[[], RoutedTokens]:
        """The copies of this rank's rows (:meth:`Transport.launch_dispatch`), made now: nothing travels."""
        if problem is not None:
            problem.record(problem.bits, x_TD.device)
        N = ids_TK.numel()
        order = expert_order(ids_TK, 0, self.num_experts, N)  # every copy here: its rows are the combine's handle
        routed = routed_copies(x_TD, order, weights_TK, N, fp8_rows=fp8_rows, handle=order[0])
        return lambda: routed

    def launch_combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> Callable[[], torch.Tensor]:
        """The experts summed each token's weighted copies already: ``y_QD`` is the output (experts that
        return a row per copy, ``routed.copies_TK`` withheld, are summed here, now)."""
        out_TD = y_QD if routed.copies_TK is not None else weighted_combine(y_QD, routed.handle, None)
        return lambda: out_TD


class AllToAllTransport(SentBack):
    """Expert parallel over ``axis``: experts are contiguous blocks of ``e = E / n`` per rank.

    Dispatch: each token once to each rank holding any of its experts (``dedup.py``); exchange the
    ``(n, e + 1)`` counts (copies per remote expert, rows per rank) and every rank's problem bits with one
    ``all_to_all_single`` plus ONE explicit host transfer (the documented sync of sync mode, counted by
    ``spmdmoe.host.host_sync_count``); ``all_to_all_single`` of the rows with their ids and weights;
    then the received rows fanned out to the local experts (``routed.routed_copies``). ``raises``: whether
    a problem reported by any rank raises at the exchange (the axis spans every rank the layer talks to)
    or is recorded for the step boundary (see the module docstring). Combine: the experts' row per
    received token back (the reverse all-to-all), summed over the ranks a token visited. Backward: the
    same moves reversed (gathers, never scatter-adds). Zero rows anywhere are fine.
    """

    backward_in_flight = True

    def __init__(self, axis: MeshAxis, num_experts: int, raises: bool = True):
        super().__init__(axis, num_experts)
        self.raises = raises

    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *,
                        problem: Optional[Problem] = None, fp8_rows: bool = False) -> Callable[[], RoutedTokens]:
        """:meth:`Transport.launch_dispatch`: the count exchange and its host read now (the send positions
        issued while the counts travel), then the rows with their ids and weights launched."""
        problem = problem if problem is not None else Problem()
        n, e = self.axis.size, self.local_experts
        need_Tn = destinations(ids_TK, e, n)
        counts = count_per_expert(ids_TK, self.num_experts).view(n, e)
        dev = self.axis.metadata_device()
        marker = 0 if torch.is_grad_enabled() else GRAD_OFF  # grad mode rides too: a mix would hang backward
        read_sizes = exchange_split_sizes(counts.to(dev), need_Tn.sum(0).to(dev), problem.bits | marker, self.axis,
                                          problem.details)
        pos_Tn = send_positions(need_Tn)  # issued while the counts travel
        send, recv, sizes, codes = read_sizes()
        if torch.compiler.is_compiling():
            problem.record(problem.bits, x_TD.device)  # no data-dependent raise in a graph: the step boundary raises
            for c in send + recv + sizes:  # facts about the traced counts that the tracer cannot see
                torch._check(c >= 0)
            # a token goes to a rank once, a row received has at most K copies here: the row buffers are exact,
            # so none is zero-filled (kernels/fan_out.py)
            torch._check(sum(send) <= ids_TK.shape[0] * n)
            torch._check(sum(sizes) <= sum(recv) * ids_TK.shape[1])
        elif any(codes := grad_mode_codes(codes)):
            mine = codes[self.axis.rank]
            if self.raises:
                raise_if(problems_error("MoE dispatch", codes, problem.details if mine else [], self.axis.ranks))
            problem.record(mine, x_TD.device)
        received = launch_tokens(x_TD, ids_TK, weights_TK, pos_Tn, send, recv, self.axis, e, sum(sizes))
        return lambda: routed_copies(*received(), sum(sizes), fp8_rows=fp8_rows, group_sizes=sizes,
                                     handle=Sent(pos_Tn, send, recv))


def transport_for(ep: Optional[MeshAxis], ep_mode: str, num_experts: int, top_k: int,
                  capacity_factor: Optional[float], raises: bool, overflow: torch.Tensor
                  ) -> Union[Transport, SizedTransport]:
    """The transport of a layer with experts split over ``ep`` (``None``: all local) in ``ep_mode``
    (``"sync"`` or ``"sync_free"``; the module table): a :class:`SizedTransport` for ``"sync_free"``, whose
    overflow buffer is ``overflow`` (int64 ``(4,)`` on the layer's device; unused by the others). ``raises``:
    whether the sync transport raises the problems its count exchange carries (its axis spans every rank the
    layer talks to)."""
    if ep is None or ep.size == 1:
        return LocalTransport(num_experts)
    makers = {"sync": lambda: AllToAllTransport(ep, num_experts, raises=raises),
              "sync_free": lambda: (SymmetricTransport if symmetric_usable(ep) else SyncFreeTransport)(
                  ep, num_experts, top_k, capacity_factor, overflow)}
    return makers[ep_mode]()
