"""Token dispatch and combine: one small interface, one class per transport.

Legend: ``T`` tokens routed here, ``D`` model dim, ``K`` top-k, ``N = T*K``
routed copies, ``E`` experts, ``e`` local experts, ``n`` EP ranks, ``R`` rows
received by this rank's experts.

Interface (docs/design.md §5)::

    routed = transport.dispatch(x_TD, ids_TK, problem=code)   # -> RoutedTokens
    out_TD = transport.combine(y_RD, routed, weights_TK)

``LocalTransport`` (no EP: every expert is local) and ``AllToAllTransport``
(EP, sync mode) share the sort and the gathers of ``permute.py``; which one a
layer uses follows from the meshes it was given.

``problem``: this rank's problem bits for the forward (``spmdmoe.agreement``:
a bad input, non-finite router logits). ``AllToAllTransport`` carries them in
its count exchange (mode (a)): when its EP axis spans every rank the layer
talks to, every rank raises right there; otherwise each rank records its own
bits in the sticky flag (mode (c)) and the step goes on, so that no rank
leaves a peer waiting, and the step boundary raises everywhere.
``LocalTransport`` has no exchange: it records (mode (c)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ..agreement import ProblemFlag, raise_problems
from ..collectives.alltoall import exchanged_op, exchange_with_codes
from ..types.mesh import MeshAxis
from ..types.routed import RoutedTokens
from .permute import gather_rows, sort_by_expert, weighted_combine

__all__ = ["LocalTransport", "AllToAllTransport", "Problem"]


@dataclass
class Problem:
    """This rank's problem bits for one forward and the details only it can write.

    ``bits`` is a host int, or a device int64 scalar once a device-side check
    (non-finite logits) joined: reading it would sync, so only the transports
    move it (into an exchange or the sticky flag).
    """

    bits: Union[int, torch.Tensor] = 0
    details: list[str] = field(default_factory=list)
    flag: Optional[ProblemFlag] = None  # where the bits are recorded when they are not raised at once

    def record(self, bits: Union[int, torch.Tensor], device: torch.device) -> None:
        if self.flag is not None:
            self.flag.record(bits, device, self.details)


@dataclass(frozen=True)
class _Sorted:
    order_N: torch.Tensor
    pos_N: torch.Tensor


def _fan_out(x_TD: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, _Sorted]:
    """The ``N`` routed copies of the rows in stable expert order, and the per-expert counts."""
    T, K = ids_TK.shape
    order_N, pos_N, counts_E = sort_by_expert(ids_TK, num_experts)
    x_ND = gather_rows(x_TD, torch.div(order_N, K, rounding_mode="floor"), pos_N.view(T, K))
    return x_ND, counts_E, _Sorted(order_N, pos_N)


class LocalTransport:
    """Every expert lives on this rank: sort, group, and un-sort. No communication, no sync.

    ``problem`` bits are recorded in the layer's sticky flag (``spmdmoe.agreement.ProblemFlag``).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, *, problem: Optional[Problem] = None) -> RoutedTokens:
        if problem is not None:
            problem.record(problem.bits, x_TD.device)
        x_ND, counts_E, srt = _fan_out(x_TD, ids_TK, self.num_experts)
        offsets = counts_E.cumsum(0).to(torch.int32)
        return RoutedTokens(x_ND, offsets, x_ND.shape[0], None, srt)

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        srt: _Sorted = routed.handle
        return weighted_combine(y_RD, srt.pos_N, srt.order_N, weights_TK)


@dataclass(frozen=True)
class _Exchange:
    srt: _Sorted
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

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, *, problem: Optional[Problem] = None) -> RoutedTokens:
        problem = problem or Problem()
        n, e = self.axis.size, self.local_experts
        x_ND, counts_E, srt = _fan_out(x_TD, ids_TK, self.num_experts)
        counts = counts_E.view(n, e).to(self.axis.metadata_device())
        send_flat, recv_flat, codes = exchange_with_codes(counts, problem.bits, self.axis)
        if any(codes):
            mine = codes[self.axis.rank]
            if self.raises:
                raise_problems("MoE dispatch", codes, problem.details if mine else [], ranks=self.axis.ranks)
            problem.record(mine, x_TD.device)
        send = [sum(send_flat[r * e : (r + 1) * e]) for r in range(n)]
        recv = [sum(recv_flat[r * e : (r + 1) * e]) for r in range(n)]
        x_recv = exchanged_op(x_ND, send, recv, self.axis, 0)
        perm_R, offsets, sizes = _expert_major(recv_flat, n, e, x_ND.device)
        inv_R = torch.empty_like(perm_R)
        inv_R.scatter_(0, perm_R, torch.arange(perm_R.numel(), device=perm_R.device))
        x_RD = gather_rows(x_recv, perm_R, inv_R.view(-1, 1))
        return RoutedTokens(x_RD, offsets, x_RD.shape[0], sizes, _Exchange(srt, send, recv, perm_R, inv_R))

    def combine(self, y_RD: torch.Tensor, routed: RoutedTokens, weights_TK: torch.Tensor) -> torch.Tensor:
        ex: _Exchange = routed.handle
        y_recv = gather_rows(y_RD, ex.inv_R, ex.perm_R.view(-1, 1))
        y_ND = exchanged_op(y_recv, ex.recv, ex.send, self.axis, 0)
        return weighted_combine(y_ND, ex.srt.pos_N, ex.srt.order_N, weights_TK)


def _expert_major(recv_flat: list[int], n: int, e: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The gather index from source-major (src, expert) blocks to expert-major (expert, src) blocks,
    the int32 group offsets and the host group sizes; one host-to-device copy."""
    starts, at = {}, 0
    for src in range(n):
        for j in range(e):
            starts[src, j] = at
            at += recv_flat[src * e + j]
    deltas, lengths, dst = [], [], 0
    for j in range(e):
        for src in range(n):
            rows = recv_flat[src * e + j]
            deltas.append(starts[src, j] - dst)
            lengths.append(rows)
            dst += rows
    sizes = [sum(recv_flat[src * e + j] for src in range(n)) for j in range(e)]
    ends = [sum(sizes[: j + 1]) for j in range(e)]
    table = torch.tensor(deltas + lengths + ends, dtype=torch.int64).to(device)
    segments = n * e
    perm = torch.arange(at, device=device) + torch.repeat_interleave(
        table[:segments], table[segments : 2 * segments], output_size=at
    )
    return perm, table[2 * segments :].to(torch.int32), sizes
