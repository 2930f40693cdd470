"""Sync-free EP dispatch and combine: static capacity, device-side counts (``ep_mode="sync_free"``).

Legend: ``T`` tokens routed here, ``D`` model dim, ``K`` top-k, ``E`` experts,
``e`` local experts, ``n`` EP ranks, ``S`` rows of one (source, destination)
slot, ``Q = n*S`` rows of a send or receive buffer and of the experts'
capacity buffer, ``R`` the experts' rows (``RoutedTokens.x_RD``: here ``R = Q``).

The sync transport (``AllToAllTransport``) reads the split sizes on the host
once per forward. This one never does: every size is a host int fixed before
any data is seen, so a forward and backward make no host sync and can be
captured in a CUDA graph.

* ``T_max``, the most tokens any rank routes, and the layer's overflow buffer come in a
  :class:`Capacity` from the layer (``ParallelMoE``): with EP on the SP axis ``T_max`` is the SP input's
  padded local count; otherwise ``max_tokens``, or one host all-reduce per forward when that is ``None``.
* ``S = T_max * min(K, e)`` rows per (source, destination) slot is lossless
  (a token picks at most ``min(K, e)`` of one rank's experts); with
  ``capacity_factor = c``, ``S = ceil(c * T_max * K / n)`` (``c`` times
  perfectly balanced traffic), never above the lossless size.
* Counts: one ``all_gather`` of every rank's ``(E,)`` expert counts, so every
  rank holds the same ``(n, E)`` table and computes from it, on the device,
  the same per-slot demand, the same overflow verdict, the rows kept per
  (source, destination, expert) (the first ``S`` of each slot in expert
  order), its receive offsets and the group offsets.
* Rows: each copy is fanned out straight from ``x_TD`` into its slot of the
  ``(Q, D)`` send buffer (a copy past its slot's ``S`` rows goes to a dump
  row that is never sent: nothing is written out of bounds), one even
  ``all_to_all_single`` of ``S`` rows per rank pair (the padded-even
  transport: NCCL, gloo, any backend), and a fan-out of the received rows
  into expert-major order (``RoutedTokens.capacity = Q``, rows past the
  device ``valid_rows`` are zero and never read by the experts).
* Combine: the inverse fan-out, the reverse even exchange, and the weighted
  gather-sum over the ``K`` copies (a dropped copy reads a zero row).
  Backward: the same moves reversed (gathers and sums, no scatter-add).

Overflow (with a ``capacity_factor``, or when a rank routes more than ``T_max``) is never silent:
the worst slot demand since the last check is kept in the layer's buffer (identical on every rank of
the EP group, computed from the same table). The layer's ``check_capacity()`` and
``update_expert_bias()`` read it (:meth:`SyncFreeTransport.overflow_message`, one host read) and
record it as a problem in the sticky flag, which their collective over every rank of the layer turns
into :class:`spmdmoe.SPMDCapacityError` on all of them (other EP groups included), naming the needed
and configured rows and a factor that fits; that step's load counts are dropped. Dropped copies
contribute zero to the output until then.

Problem bits (a bad input on this rank) are recorded in the sticky flag
(agreement mode (c)): the step boundary raises on every rank; the collectives
here never depend on them, so no rank is left waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed._functional_collectives as funcol

from .._dist import all_gather_single, all_reduce
from ..agreement import BIT, Found, global_rank
from ..sticky import Problem
from ..collectives.alltoall import exchanged_op
from ..host import to_host
from ..types import layout
from ..types.mesh import MeshAxis
from .routed import RoutedTokens
from .permute import expert_major, scatter_rows, sort_by_expert, weighted_combine
from .token_exchange import exchange_tokens

__all__ = ["Capacity", "SyncFreeTransport", "layer_capacity", "record_overflow", "slot_rows"]


class Capacity(NamedTuple):
    """What the layer hands the transport each forward: ``T_max`` (host int, the same on every rank of the EP
    group) and its overflow buffer (int64 ``(4,)``: excess rows, needed rows, slot rows, ``T_max`` of the worst
    overflow since the last check; a layer buffer, so it moves with the layer, has a static address for CUDA
    graphs and is mutable under compile)."""

    t_max: int
    overflow: torch.Tensor


def slot_rows(t_max: int, top_k: int, local_experts: int, ranks: int, capacity_factor: Optional[float]) -> int:
    """``S``, the rows of one (source, destination) slot: lossless for ``None``, else ``capacity_factor``
    times balanced traffic (``T_max * K / n``), rounded up and capped at the lossless size."""
    lossless = t_max * min(top_k, local_experts)
    if capacity_factor is None:
        return lossless
    return min(lossless, math.ceil(capacity_factor * t_max * top_k / ranks))


def layer_capacity(layer: Any, x: Any, x_TD: Optional[torch.Tensor], found: Found) -> Optional[Capacity]:
    """The :class:`Capacity` a parallel layer hands its transport this forward (``None`` unless it is sync-free
    EP): ``T_max``, the most rows any rank of the EP group routes, and the layer's overflow buffer.

    EP on the SP axis: the SP input's padded local count, from the token exchange (``token_exchange.py``; no
    host read on a rank whose input is good). Otherwise ``layer.max_tokens`` (more rows here, ``x_TD``: a
    problem added to ``found``, raised on every rank at the step boundary; this rank stands in zero rows), or,
    when that is ``None``, one host all-reduce (MAX) of the routed rows over EP: the documented sync of that
    case."""
    ep = layer.ep
    if not isinstance(layer.transport, SyncFreeTransport) or ep is None:
        return None
    if layer.sp is not None and layer.sp == ep:
        T = layout.padded_local_tokens(max(exchange_tokens(x, found, layer.sp, layer._ride), 0), ep.size)
        return Capacity(T, layer.capacity_overflow)
    rows = 0 if x_TD is None else x_TD.shape[0]
    if layer.max_tokens is not None:
        if rows > layer.max_tokens:
            found.add("capacity", f"rank {global_rank()}: {rows} tokens routed, more than max_tokens="
                                  f"{layer.max_tokens}, which sizes the sync-free EP buffers; split the batch "
                                  "or pass a larger max_tokens to parallelize_moe")
        return Capacity(layer.max_tokens, layer.capacity_overflow)
    most = torch.full((1,), rows, dtype=torch.int64, device=ep.metadata_device())
    all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=ep.group)
    return Capacity(int(to_host(most)[0]), layer.capacity_overflow)


def record_overflow(layer: Any) -> None:
    """A sync-free EP layer: read its overflow buffer (one host read) and record an overflow since the last
    check as a ``capacity`` problem in its sticky flag, for the next step-boundary collective to raise on
    every rank; any other layer: nothing."""
    transport = layer.transport
    if isinstance(transport, SyncFreeTransport):
        message = transport.overflow_message(layer.capacity_overflow, f"MoE layer (sync-free EP over {layer.ep})")
        if message is not None:
            layer.problems.record(BIT["capacity"], layer.capacity_overflow.device, [message])


@dataclass(frozen=True)
class _Handle:
    send_pos_TK: torch.Tensor  # copy (t, k)'s row in the send buffer (Q: dropped)
    read_Q: torch.Tensor  # expert-major row r came from received row read_Q[r] (Q: none; permute.expert_major)
    slot: int
    droppable: bool


class SyncFreeTransport:
    """EP over ``axis`` with static capacity and no host sync (see the module docstring)."""

    def __init__(self, axis: MeshAxis, num_experts: int, top_k: int, capacity_factor: Optional[float]):
        self.axis = axis
        self.num_experts = num_experts
        self.local_experts = num_experts // axis.size
        self.top_k = top_k
        self.capacity_factor = capacity_factor

    def _count_table(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(E,)`` counts, ``(n, E)``, the same on every rank (one all-gather, no host read)."""
        n, E = self.axis.size, counts_E.shape[0]
        if torch.compiler.is_compiling():
            return funcol.all_gather_tensor(counts_E, 0, self.axis.group).view(n, E)
        mine = counts_E if counts_E.is_meta else counts_E.to(self.axis.metadata_device())  # meta: planning only
        table = torch.empty((n * E,), dtype=mine.dtype, device=mine.device)
        all_gather_single(table, mine, group=self.axis.group)
        return table.view(n, E).to(counts_E.device)

    @staticmethod
    def _record(state: torch.Tensor, needed: torch.Tensor, S: int, t_max: int) -> None:
        now = torch.stack([needed - S, needed, torch.full_like(needed, S), torch.full_like(needed, t_max)])
        state.copy_(torch.where(now[0] > state[0], now, state))

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, *, problem: Optional[Problem] = None,
                 capacity: Optional[Capacity] = None, fp8_rows: bool = False,
                 weights_TK: Optional[torch.Tensor] = None) -> RoutedTokens:
        """This rank's routed copies into its EP peers' experts, with no host read (module docstring).

        Args:
            x_TD: ``(T, D)`` rows routed here (bf16 / fp32; ``T`` may be 0 and may differ between ranks, at
                most ``capacity.t_max`` unless a capacity factor may drop copies).
            ids_TK: int64 ``(T, K)`` global expert ids of each row's ``K`` copies.
            problem: this rank's problem bits, recorded in the layer's sticky flag (never read here).
            capacity: ``T_max`` (host int, the same on every rank of the EP group) and the layer's
                overflow buffer, updated on the device with this forward's worst slot demand.
            fp8_rows, weights_TK: ignored (FP8 experts quantize the rows that arrive; the combine weights
                the rows that come back).

        Returns ``RoutedTokens`` with ``x_RD`` ``(Q, D)``, ``Q = n * S``: this rank's ``e`` experts' rows in
        expert-major order (source rank order within an expert), rows past the int32 ``group_offsets[-1]``
        zero; ``capacity = Q``; ``group_sizes = None`` (never on the host); the handle the combine needs
        (each copy's send row, ``Q`` when dropped, and the inverse of the received rows' fan-out).
        Collectives: one all-gather of the ``(E,)`` counts and one even all-to-all of ``Q`` rows over EP
        (their reverse in the backward)."""
        if capacity is None:
            raise TypeError("SyncFreeTransport.dispatch needs a Capacity (T_max and the overflow buffer)")
        t_max = capacity.t_max
        if problem is not None:
            problem.record(problem.bits, x_TD.device)
        n, e, me = self.axis.size, self.local_experts, self.axis.rank
        S = slot_rows(t_max, self.top_k, e, n, self.capacity_factor)
        Q = n * S
        pos_TK, counts_E = sort_by_expert(ids_TK, self.num_experts)
        table_nne = self._count_table(counts_E).view(n, n, e)  # [source, destination, local expert]
        needed = table_nne.sum(-1).max()
        self._record(capacity.overflow, needed, S, t_max)
        # a copy of this rank's can be dropped only with a factor, or when it routes more than T_max rows
        droppable = self.capacity_factor is not None or x_TD.shape[0] > t_max
        # rows kept per (source, destination, expert): the first S of each slot, in expert order
        kept_cum = table_nne.cumsum(-1).clamp(max=S)
        kept_nne = torch.diff(kept_cum, dim=-1, prepend=kept_cum.new_zeros(n, n, 1))
        # sender: copy (t, k) sits at pos in expert order; its slot is its expert's rank
        mine_ne = table_nne[me]
        slot_start_n = mine_ne.sum(-1).cumsum(0) - mine_ne.sum(-1)
        dst_TK = ids_TK // e
        within_TK = pos_TK - slot_start_n[dst_TK]
        send_pos_TK = torch.where(within_TK < S, dst_TK * S + within_TK, Q)
        send_QD = scatter_rows(x_TD, send_pos_TK, Q + 1)[:Q]
        recv_QD = exchanged_op(send_QD, [S] * n, [S] * n, self.axis, 0)
        # receiver: source i's rows sit in its slot, rows [i*S, i*S + kept) by local expert; to expert-major order
        read_Q, write_Q, offsets_e = expert_major(kept_nne[:, me, :], Q, S)
        x_RD = scatter_rows(recv_QD, write_Q.view(Q, 1), Q + 1)[:Q]
        return RoutedTokens(x_RD, offsets_e, Q, None, _Handle(send_pos_TK, read_Q, S, droppable))

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        h: _Handle = routed.handle
        n = self.axis.size
        Q = n * h.slot
        y_recv = scatter_rows(y_RD, h.read_Q.view(-1, 1), Q + 1)[:Q]  # rows past valid: into the dump row
        y_send = exchanged_op(y_recv, [h.slot] * n, [h.slot] * n, self.axis, 0)
        if h.droppable:  # a dropped copy reads this zero row
            y_send = torch.cat([y_send, y_send.new_zeros((1, y_send.shape[1]))])
        return weighted_combine(y_send, h.send_pos_TK, weights_TK)

    def overflow_message(self, state: torch.Tensor, layer: str) -> Optional[str]:
        """What overflowed since the last check (``None``: nothing), read from ``state`` (one host read; the
        same on every rank of the EP group), which then starts afresh."""
        excess, needed, slot, t_max = to_host(state)
        state.zero_()
        if excess <= 0:
            return None
        n, K = self.axis.size, self.top_k
        head = (f"{layer}: rank {self.axis.rank}: sync-free EP capacity exceeded: a (source, destination) slot "
                f"needed {needed} rows, the buffers hold {slot} per slot; the rows past them were dropped (their "
                f"expert outputs counted as zero) since the last check")
        if self.capacity_factor is None:  # lossless buffers overflow only when a rank routed more than T_max
            return head + (f"; a rank routed more than T_max={t_max} tokens (max_tokens): split its batch or "
                           "raise max_tokens")
        balanced = t_max * K / n
        fits = math.ceil(needed / balanced * 100) / 100 if balanced else float("inf")
        return head + (f" (capacity_factor={self.capacity_factor} x balanced traffic T_max*K/ep = {t_max}*{K}/{n}). "
                       f"Use capacity_factor >= {fits} (or None: lossless), or rerun the step with "
                       "layer.set_ep_mode('sync')")
