"""Rank-deduplicated EP dispatch: a token crosses once to each rank that holds any of its experts.

Legend: ``T`` tokens routed here, ``K`` top-k, ``D`` model dim, ``E`` experts, ``e`` local experts (a block
of ``e`` per EP rank), ``n`` EP ranks, ``S`` rows of one sync-free (source, destination) slot, ``Q`` rows
received (``n * S`` sync-free, the sum of the received rows in sync mode).

A token routed to ``K`` experts needs a rank whenever one of its experts lives there: it is sent there once,
with its ``K`` expert ids and routing weights (DeepEP's normal kernels do the same). The receiver fans it out
to its local experts (``routed.routed_copies``; the other ranks' ids are ``-1`` there), the experts return the
weighted sum of its local copies, and that one row per (token, rank) goes back; the sender sums a token's
rows over the ranks it visited (``permute.weighted_combine`` without weights, ``-1`` where it visited none).
At top-6 of 64 experts on 2 ranks a token needs the other rank with probability ``1 - C(32,6)/C(64,6)`` =
0.988: about 16.2k rows cross per 16k tokens instead of 49.2k copies.

Summation order: a token's output is ``sum_rank round(sum_k w_k * y_k)``: each rank's partial sum is rounded
once to the rows' dtype (it travels in it) before the sender's fp32 sum over ranks, the same order on every
transport (so the synced and sync-free transports agree bit for bit).

A token's routing weights and ids travel in its row: :func:`launch_tokens` sends one buffer of the rows' dtype,
``P`` columns a row: the row's ``D``, then from column ``round_up(D, 16)`` the bits of its fp32 ``(2K,)`` weights
and ids (ids exact in fp32 below 2**24 experts; fp64 with fp64 weights), the rest unspecified (``P`` a multiple of
16: aligned rows). One exchange each way; the weights' gradient comes back in its backward, summed in their dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...collectives.alltoall import exchange_launched, exchanged_op
from ...kernels import expert_order, fan_out, gather_sum
from ...types.mesh import MeshAxis
from ..routing.permute import weighted_combine
from .routed import Dispatching, RoutedTokens

__all__ = ["destinations", "send_positions", "pack_meta", "received_order", "launch_tokens", "Sent", "SentBack"]


def destinations(ids_TK: torch.Tensor, local_experts: int, ranks: int) -> torch.Tensor:
    """bool ``(T, n)``: whether token ``t`` has an expert on rank ``d`` (experts in blocks of ``e`` a rank)."""
    need_Tn = torch.zeros((ids_TK.shape[0], ranks), dtype=torch.bool, device=ids_TK.device)
    return need_Tn.scatter_(1, ids_TK // local_experts, True)


def send_positions(need_Tn: torch.Tensor, slot: Optional[int] = None) -> torch.Tensor:
    """int64 ``(T, n)``: token ``t``'s row in the send buffer for rank ``d``, or ``-1`` (not sent there).

    Rows for rank ``d`` in token order (:func:`spmdmoe.kernels.expert_order` with the ranks as the experts);
    ``slot=None``: the blocks packed (rank ``d``'s block starts after the rows for ranks ``< d``: the sync
    transport's exact buffer); ``slot=S``: rank ``d``'s block at ``d * S``, and a token past its block's ``S``
    rows is not sent (``-1``: dropped, the sync-free capacity's overflow). No scan over the 2-D table (inductor
    on torch 2.11 failed to generate one; torch's eager scan took 1.6 ms at ``T = 16k``, issues 41, 42)."""
    T, n = need_Tn.shape
    rank_n = torch.arange(n, device=need_Tn.device)
    packed_Tn, ends_n, rows_n = expert_order(torch.where(need_Tn, rank_n, -1), 0, n, T * n)
    if slot is None:
        return packed_Tn
    within_Tn = packed_Tn - (ends_n - rows_n)
    return torch.where(need_Tn & (within_Tn < slot), rank_n * slot + within_Tn, -1)


def pack_meta(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """``(T, 2K)`` in the weights' dtype (fp32, or fp64 for fp64 weights): a token's routing weights then its
    expert ids (exact below 2**24), to travel with it."""
    dtype = torch.promote_types(weights_TK.dtype, torch.float32)
    return torch.cat([weights_TK.to(dtype), ids_TK.to(dtype)], dim=1)


def received_order(ids_QK: torch.Tensor, rank: int, local_experts: int, rows: int,
                   valid_Q: Optional[torch.Tensor] = None, total: Optional[int] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`spmdmoe.kernels.expert_order` of the received rows' ids (as they arrived: fp32 beside the weights)
    for this rank's experts into ``rows``, counting the ids below ``total`` (a copy of another rank's expert, or of
    a row ``valid_Q`` marks dead: a sync-free slot's unused tail, has none)."""
    ids_QK = ids_QK.detach()
    if valid_Q is not None:
        ids_QK = torch.where(valid_Q.unsqueeze(1), ids_QK, -1.0)
    return expert_order(ids_QK, rank * local_experts, local_experts, rows, total)


Received = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def _meta(rows_P: torch.Tensor, D: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``(rows, 2K)`` weights-and-ids view (``dtype``) of a packed buffer (the module docstring)."""
    return rows_P[:, _up16(D):_up16(D) + 2 * K * dtype.itemsize // rows_P.dtype.itemsize].view(dtype)


def _pack(x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, pos_Tn: torch.Tensor, sent: int,
          dtype: torch.dtype) -> torch.Tensor:
    """The send buffer ``(sent, P)``: each row with its weights and ids (``dtype``) at its positions."""
    (T, D), K = x_TD.shape, ids_TK.shape[1]
    rows_TP = x_TD.new_empty((T, _up16(_up16(D) + 2 * K * dtype.itemsize // x_TD.dtype.itemsize)))
    rows_TP[:, :D] = x_TD
    meta_TW = _meta(rows_TP, D, K, dtype)
    meta_TW[:, :K], meta_TW[:, K:] = weights_TK, ids_TK
    return fan_out(rows_TP, pos_Tn, sent)[0]


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,  # type: ignore[override]
                pos_Tn: torch.Tensor, sent: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(pos_Tn)
        ctx.shape = (x_TD.shape[1], ids_TK.shape[1], dtype, weights_TK.dtype)
        return _pack(x_TD, weights_TK, ids_TK, pos_Tn, sent, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_SP: torch.Tensor) -> Any:  # type: ignore[override]
        (pos_Tn,), (D, K, dtype, w_dtype) = ctx.saved_tensors, ctx.shape
        g_TK = gather_sum(_meta(g_SP, D, K, dtype)[:, :K], pos_Tn).to(w_dtype)
        return gather_sum(g_SP[:, :D], pos_Tn), g_TK, None, None, None, None


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows_QP: torch.Tensor, D: int, K: int, dtype: torch.dtype  # type: ignore[override]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.like = (D, K, dtype), rows_QP.new_empty((0, rows_QP.shape[1]))
        meta_QW = _meta(rows_QP, D, K, dtype)
        ctx.mark_non_differentiable(ids_QK := meta_QW[:, K:])
        return rows_QP[:, :D], meta_QW[:, :K], ids_QK

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_QD: Optional[torch.Tensor], g_QK: Optional[torch.Tensor],  # type: ignore[override]
                 _ids: Any) -> Any:
        (D, K, dtype), rows = ctx.shape, (g_QD if g_QD is not None else g_QK).shape[0]  # type: ignore[union-attr]
        g_QP = ctx.like.new_empty((rows, ctx.like.shape[1]))  # the ids' columns and the pad: never read
        for part, g in ((g_QP[:, :D], g_QD), (_meta(g_QP, D, K, dtype)[:, :K], g_QK)):
            part.copy_(g) if g is not None else part.zero_()
        return g_QP, None, None, None


def launch_tokens(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, pos_Tn: torch.Tensor,
                  send: list[int], recv: list[int], axis: MeshAxis, local_experts: int, rows: int,
                  live_Q: Optional[torch.Tensor] = None) -> Callable[[], Received]:
    """Each token to the ranks ``pos_Tn`` names (:func:`send_positions`), with its ids and weights in its row (the
    module docstring), started now; the call it returns waits and gives ``(x_QD, order, weights_QK)``: the rows
    received (source-major, ``recv`` from each rank), their copies' order for this rank's experts in ``rows`` rows
    (:func:`received_order`; a row ``live_Q`` marks dead has none), and the weights (differentiable). One
    ``all_to_all_single`` over ``axis`` (``send`` rows to each rank), in flight until that call
    (:func:`spmdmoe.collectives.alltoall.exchange_launched`); its reverse in the backward."""
    D, K, dtype = x_TD.shape[1], ids_TK.shape[1], torch.promote_types(weights_TK.dtype, torch.float32)
    wait = exchange_launched(_Pack.apply(x_TD, weights_TK, ids_TK, pos_Tn, sum(send), dtype), send, recv, axis, 0)

    def received() -> Received:
        x_QD, weights_QK, ids_QK = _Unpack.apply(wait(), D, K, dtype)
        return x_QD, received_order(ids_QK, axis.rank, local_experts, rows, live_Q), weights_QK
    return received


@dataclass(frozen=True)
class Sent:
    """What the combine needs of a dispatch's exchange (:func:`launch_tokens`)."""

    pos_Tn: torch.Tensor  # token t's row in the send buffer for rank d (-1: not sent there, or dropped)
    send: list[int]  # rows sent to each EP rank
    recv: list[int]  # rows received from each EP rank


class SentBack(Dispatching):
    """An EP transport over ``axis`` (a block of ``e = E / n`` experts a rank) whose dispatch sends with
    :func:`launch_tokens` (its handle a :class:`Sent`) and whose combine is that exchange reversed."""

    def __init__(self, axis: MeshAxis, num_experts: int):
        super().__init__()
        self.axis, self.num_experts, self.local_experts = axis, num_experts, num_experts // axis.size

    def launch_combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> Callable[[], torch.Tensor]:
        """:meth:`Transport.launch_combine`: the experts' row per received token back to its rank (the reverse of
        :func:`launch_tokens`' exchange ``routed.handle``), started now; the call it returns waits and gives each
        token's rows summed over the ranks it visited (fp32, rounded once): ``(T, D)``. One ``all_to_all_single``
        over ``axis`` in flight until that call (:func:`spmdmoe.collectives.alltoall.exchange_launched`); its
        reverse in the backward."""
        sent: Sent = routed.handle
        rows_wait = exchange_launched(y_QD, sent.recv, sent.send, self.axis, 0)
        return lambda: weighted_combine(rows_wait(), sent.pos_Tn, None)

    def combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> torch.Tensor:
        """:meth:`Transport.combine`: :meth:`launch_combine` waited for at once (one ``all_to_all_single``, one
        autograd node each way: nothing is issued between its launch and its wait, so none is made)."""
        sent: Sent = routed.handle
        return weighted_combine(exchanged_op(y_QD, sent.recv, sent.send, self.axis, 0), sent.pos_Tn, None)
