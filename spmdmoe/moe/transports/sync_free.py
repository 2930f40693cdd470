"""Sync-free EP dispatch and combine: static capacity, device-side counts (``ep_mode="sync_free"``).

Legend: ``T`` tokens routed here, ``D`` model dim, ``K`` top-k, ``E`` experts,
``e`` local experts, ``n`` EP ranks, ``S`` rows of one (source, destination)
slot, ``Q = n*S`` rows of a send or receive buffer, ``R`` the experts' rows
(``RoutedTokens.x_RD``, a static capacity).

Every size is a host int fixed before any data is seen (``T_max`` from the layer's admission each forward; ``S``
and ``R``: :func:`capacity_rows`), so a forward and backward make no host sync and a CUDA graph captures them; a
token goes once to each rank holding any of its experts (``dedup.py``), and the results equal
``AllToAllTransport``'s bit for bit. Collectives per forward (over EP): one ``all_gather`` of every rank's ``(E,)``
expert counts and ``(n,)`` rows per destination (every rank computes from that ``(n, E + n)`` table, on the device,
the same demands and overflow verdict); an even ``all_to_all_single`` of ``S`` rows a rank pair, the rows with
their ids and weights (``dedup.launch_tokens``), every slot padded to ``S`` rows; the combine's reverse one.
Backward: the same moves reversed. Overflow is kept in the transport's ``overflow`` buffer and raised on every
rank at the step boundary, problem bits go to the sticky flag. Sizes, steps and overflow: ``docs/design.md`` §5.1.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed._functional_collectives as funcol

from ..._dist import all_gather_single
from ...agreement import BIT, Problem, ProblemSink
from ...host import to_host
from ...kernels import overflow_record
from ...types.mesh import MeshAxis
from .dedup import Sent, SentBack, destinations, launch_tokens, send_positions
from ..routing.permute import count_per_expert
from .routed import RoutedTokens, routed_copies

__all__ = ["SyncFreeTransport", "capacity_rows"]


def capacity_rows(t_max: int, top_k: int, local_experts: int, ranks: int, capacity_factor: Optional[float]
                  ) -> tuple[int, int]:
    """``(S, R)``: the rows of one (source, destination) slot and of the experts' buffer (module docstring):
    lossless for ``None``, else ``capacity_factor`` times balanced traffic, rounded up and capped at the
    lossless sizes."""
    S = t_max
    R = ranks * t_max * min(top_k, local_experts)
    if capacity_factor is None:
        return S, R
    S = min(S, math.ceil(capacity_factor * t_max * top_k / ranks))
    return S, min(ranks * S * min(top_k, local_experts), math.ceil(capacity_factor * t_max * top_k))


class SyncFreeTransport(SentBack):
    """EP over ``axis`` with static capacity and no host sync (see the module docstring)."""

    backward_in_flight = True  # the padded all-to-all's exchanges (``SymmetricTransport``: no)

    overflow: torch.Tensor

    def __init__(self, axis: MeshAxis, num_experts: int, top_k: int, capacity_factor: Optional[float],
                 overflow: torch.Tensor):
        super().__init__(axis, num_experts)
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        # the worst overflow since the last check (``dispatch.SizedTransport.overflow``): int64 (4,) on the layer's
        # device, zeros or the layer's previous sync-free transport's (``ParallelMoE.set_ep_mode``)
        self.register_buffer("overflow", overflow, persistent=False)

    def sizes(self, t_max: int) -> tuple[int, int]:
        """``(S, R)`` for ``T_max`` (:func:`capacity_rows`): the rows of a (source, destination) slot and of this
        rank's experts' buffer."""
        return capacity_rows(t_max, self.top_k, self.local_experts, self.axis.size, self.capacity_factor)

    def _count_table(self, counts_W: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(W,)`` counts, ``(n, W)``, the same on every rank (one all-gather, no host read)."""
        n, W = self.axis.size, counts_W.shape[0]
        if torch.compiler.is_compiling():
            return funcol.all_gather_tensor(counts_W, 0, self.axis.group).view(n, W)
        mine = counts_W if counts_W.is_meta else counts_W.to(self.axis.metadata_device())  # meta: planning only
        table = torch.empty((n * W,), dtype=mine.dtype, device=mine.device)
        all_gather_single(table, mine, group=self.axis.group)
        return table.view(n, W).to(counts_W.device)

    def _record(self, slot_needed: torch.Tensor, rows_needed: torch.Tensor, S: int, R: int, t_max: int) -> None:
        """Keep the worst demand in :attr:`overflow`: its excess in thousandths of balanced traffic (``> 0``:
        overflowed), the slot and expert rows needed, ``T_max``."""
        balanced = max(t_max * self.top_k, 1)  # an experts' buffer's balanced rows; a slot's: that / n
        overflow_record(slot_needed, rows_needed, self.overflow, S, R, self.axis.size, balanced, t_max)

    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *, t_max: int,
                        problem: Optional[Problem] = None, fp8_rows: bool = False) -> Callable[[], RoutedTokens]:
        """This rank's tokens to their experts' ranks, with no host read, started now (the collectives: module
        docstring; the arguments, ``t_max`` among them, and the call: :meth:`SizedTransport.launch_dispatch`'s).
        The call returns ``RoutedTokens`` with ``x_RD`` ``(R, D)``, ``R`` from :func:`capacity_rows`: this rank's
        ``e`` experts' copies in expert-major order (source rank order within an expert), rows past the int32
        ``group_offsets[-1]`` unspecified; ``capacity = R``; ``group_sizes = None`` (never on the host)."""
        if problem is not None:
            problem.record(problem.bits, x_TD.device)
        n, e, me, E = self.axis.size, self.local_experts, self.axis.rank, self.num_experts
        S, R = self.sizes(t_max)
        Q = n * S
        need_Tn = destinations(ids_TK, e, n)
        table = self._count_table(torch.cat([count_per_expert(ids_TK, E), need_Tn.sum(0)]))  # [source, E + n]
        self._record(table[:, E:].max(), table[:, :E].sum(0).view(n, e).sum(1).max(), S, R, t_max)
        pos_Tn = send_positions(need_Tn, S)
        # received slot i's first min(rows sent, S) rows are live, the rest of it never read
        live_Q = (torch.arange(S, device=x_TD.device) < table[:, E + me, None]).reshape(Q)
        sent = Sent(pos_Tn, [S] * n, [S] * n)
        received = launch_tokens(x_TD, ids_TK, weights_TK, pos_Tn, sent.send, sent.recv, self.axis, e, R, live_Q)
        return lambda: routed_copies(*received(), R, fp8_rows=fp8_rows, handle=sent)

    def record_overflow(self, flag: ProblemSink, layer: str) -> None:
        """:meth:`SizedTransport.record_overflow`, the message :meth:`overflow_message`'s."""
        message = self.overflow_message(layer)
        if message is not None:
            flag.record(BIT["capacity"], self.overflow.device, [message])

    def overflow_message(self, layer: str) -> Optional[str]:
        """What overflowed since the last check (``None``: nothing), read from :attr:`overflow` (one host read;
        the same on every rank of the EP group), which then starts afresh; ``layer`` names the layer."""
        excess, slot_needed, rows_needed, t_max = to_host(self.overflow)
        self.overflow.zero_()
        if excess <= 0:
            return None
        n, K = self.axis.size, self.top_k
        S, R = self.sizes(t_max)
        head = (f"{layer}: rank {self.axis.rank}: sync-free EP capacity exceeded: a rank sent another up to "
                f"{slot_needed} rows and a rank's experts needed {rows_needed} rows, the buffers hold {S} and {R}; "
                "the tokens and copies past them were dropped (their expert outputs counted as zero) since the "
                "last check")
        if self.capacity_factor is None or slot_needed > t_max:  # no factor fits a rank above T_max
            return head + (f"; a rank routed more than T_max={t_max} tokens (max_tokens): split its batch or "
                           "raise max_tokens")
        fits = math.ceil(self.capacity_factor * 100 + excess / 10) / 100
        return head + (f" (capacity_factor={self.capacity_factor} x balanced traffic: T_max*K/ep = {t_max}*{K}/{n} "
                       f"rows a slot, T_max*K = {t_max * K} a rank's experts). Use capacity_factor >= {fits} (or "
                       "None: lossless), or rerun the step with layer.set_ep_mode('sync')")
