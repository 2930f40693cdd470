"""Top-k routing from the gate logits in one launch, and its backward in one.

Legend: ``T`` rows, ``E`` experts, ``K`` top-k, ``G`` expert groups.

Forward (``logits_TE`` fp32): ``scores`` = softmax (or sigmoid) of the logits, fp32; ``ids`` the ``K`` experts with
the largest ``scores + bias``, in descending order; ``weights`` their unbiased scores, divided by their sum
(+ 1e-20) when ``norm``; ``tally`` int64 ``(E + 1,)``: the copies per expert of the rows ``keep_T`` marks (all when
``None``), then ``flag`` if any marked row has a non-finite logit, else 0. The kernel breaks a tie to the lower id
(torch's ``topk`` to any); a NaN score is chosen last (``topk``: first), so every id is an expert and a row's
ids are distinct whatever its logits. Group-limited routing (``groups``, ``limited``: a row keeps the experts of
its ``limited`` groups with the largest sum of their two best biased scores) takes the reference.

Backward: the logits' gradient from the weights' (``g_w_TK``) and the scores' (``g_s_TE``: the aux loss; may be
``None``): ``dp = (g_w - sum(g_w * w)) / S`` when ``norm`` (``S`` the chosen scores' sum + 1e-20; else
``dp = g_w``), scattered to the chosen experts and added to ``g_s``, then the softmax's (or sigmoid's) backward.

One program per block of rows, every expert of a row in it: the ``K`` choices are ``K`` arg-maxes over the row
in registers. The counts are integer atomics (exact, order-free). They replace about fifteen small torch ops
of a routing's forward and five of its backward, each a launch and host time in an eager step (issue 61).

Measured (H200, torch 2.11, Triton 3.6, T = 16,384, E = 64, K = 6; ``benchmarks/kernels.py --only "topk route"``):
forward 0.074 ms (the reference: 0.162 eager, 0.168 compiled), backward 0.039 ms (0.053 / 0.066); latency-bound
(0.13 and 0.26 TB/s). In an eager EP 2 layer step it cut 15 launches and 11 ATen ops (``benchmarks/README.md``,
"Host cost at EP 2").
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import wrap_triton

from .backend import kernel_op, use_triton

__all__ = ["topk_route", "topk_route_reference", "topk_route_triton",
           "topk_route_backward", "topk_route_backward_reference", "topk_route_backward_triton"]


def _blocks(E: int) -> tuple[int, int]:
    """``(BT, BE)``: rows a program, the row's width in registers (a power of two)."""
    BE = triton.next_power_of_2(max(E, 1))
    return max(1, min(128, 4096 // BE)), BE


@triton.jit
def _rows(T, E, BT: tl.constexpr, BE: tl.constexpr):
    """This program's rows and columns: ``(rows int64, cols, live rows, the (BT, BE) mask, offsets)`` (no pointer:
    ``tests/test_kernel_writes.py``)."""
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    live = rows < T
    m = live[:, None] & (cols < E)[None, :]
    return rows, cols, live, m, rows[:, None] * E + cols[None, :]


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, keep_ptr, ids_ptr, w_ptr, scores_ptr, tally_ptr, T, E, flag,
                  K: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_KEEP: tl.constexpr,
                  BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    rows, cols, live, m, at = _rows(T, E, BT, BE)
    x = tl.load(logits_ptr + at, mask=m, other=0.0)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        z = tl.where(m, x, float("-inf"))
        ex = tl.exp(z - tl.max(z, axis=1)[:, None])
        s = ex / tl.sum(ex, axis=1)[:, None]
    tl.store(scores_ptr + at, s, mask=m)
    c = s + tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
    c = tl.where(m, tl.where(c == c, c, -3.0e38), float("-inf"))  # NaN below every score, padding below all
    kept = live
    if HAS_KEEP:
        kept = kept & (tl.load(keep_ptr + rows, mask=live, other=0) != 0)
    kk = tl.arange(0, BK)
    ids = tl.zeros([BT, BK], dtype=tl.int32)
    w = tl.zeros([BT, BK], dtype=tl.float32)
    hist = tl.zeros([BE], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.argmax(c, axis=1, tie_break_left=True)
        hit = cols[None, :] == best[:, None]
        ids = tl.where(kk[None, :] == k, best[:, None], ids)
        w = tl.where(kk[None, :] == k, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], w)
        hist += tl.sum((hit & kept[:, None]).to(tl.int32), axis=0)
        c = tl.where(hit, float("-inf"), c)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    km = live[:, None] & (kk < K)[None, :]
    tl.store(ids_ptr + rows[:, None] * K + kk[None, :], ids.to(tl.int64), mask=km)
    tl.store(w_ptr + rows[:, None] * K + kk[None, :], w, mask=km)
    tl.atomic_add(tally_ptr + cols, hist.to(tl.int64), mask=cols < E)
    bad = tl.sum(((x - x != 0.0) & m & kept[:, None]).to(tl.int32))  # x - x: 0 iff finite
    tl.atomic_max(tally_ptr + E, tl.where(bad > 0, flag, 0).to(tl.int64))


@triton.jit
def _route_bwd_kernel(scores_ptr, ids_ptr, w_ptr, gw_ptr, gs_ptr, out_ptr, T, E, K: tl.constexpr,
                      SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_GS: tl.constexpr, BT: tl.constexpr,
                      BE: tl.constexpr):
    rows, cols, live, m, at = _rows(T, E, BT, BE)
    s = tl.load(scores_ptr + at, mask=m, other=0.0)
    g = tl.zeros([BT, BE], dtype=tl.float32)
    if HAS_GS:
        g = tl.load(gs_ptr + at, mask=m, other=0.0)
    chosen = tl.zeros([BT], dtype=tl.float32) + 1e-20  # S
    dot = tl.zeros([BT], dtype=tl.float32)
    if NORM:
        for k in tl.static_range(K):
            idk = tl.load(ids_ptr + rows * K + k, mask=live, other=-1)
            chosen += tl.sum(tl.where(cols[None, :] == idk[:, None], s, 0.0), axis=1)
            dot += tl.load(gw_ptr + rows * K + k, mask=live, other=0.0) * tl.load(w_ptr + rows * K + k, mask=live,
                                                                                    other=0.0)
    for k in tl.static_range(K):
        idk = tl.load(ids_ptr + rows * K + k, mask=live, other=-1)
        dp = tl.load(gw_ptr + rows * K + k, mask=live, other=0.0)
        if NORM:
            dp = (dp - dot) / chosen
        g += tl.where(cols[None, :] == idk[:, None], dp[:, None], 0.0)
    if SIGMOID:
        out = g * (1.0 - s) * s
    else:
        out = s * (g - tl.sum(g * s, axis=1)[:, None])
    tl.store(out_ptr + at, out, mask=m)


@kernel_op("spmdmoe::topk_route", mutates_args=())
def topk_route_triton(logits_TE: torch.Tensor, bias_E: torch.Tensor, keep_T: Optional[torch.Tensor], K: int,
                      sigmoid: bool, norm: bool, flag: int, groups: Optional[int] = None,
                      limited: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton launcher (see the module docstring; ``groups`` must be ``None``)."""
    T, E = logits_TE.shape
    device = logits_TE.device
    ids_TK = torch.empty((T, K), dtype=torch.int64, device=device)
    w_TK = torch.empty((T, K), dtype=torch.float32, device=device)
    scores_TE = torch.empty((T, E), dtype=torch.float32, device=device)
    tally = torch.zeros((E + 1,), dtype=torch.int64, device=device)
    BT, BE = _blocks(E)
    if guard_or_true(T > 0):
        wrap_triton(_route_kernel)[(triton.cdiv(T, BT),)](
            logits_TE.contiguous(), bias_E, keep_T if keep_T is not None else logits_TE, ids_TK, w_TK, scores_TE,
            tally, T, E, flag, K=K, SIGMOID=sigmoid, NORM=norm, HAS_KEEP=keep_T is not None, BT=BT, BE=BE,
            BK=triton.next_power_of_2(K), num_warps=4)
    return ids_TK, w_TK, scores_TE, tally


@kernel_op("spmdmoe::topk_route_backward", mutates_args=())
def topk_route_backward_triton(scores_TE: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                               g_w_TK: torch.Tensor, g_s_TE: Optional[torch.Tensor], sigmoid: bool,
                               norm: bool) -> torch.Tensor:
    """The Triton launcher (see the module docstring)."""
    T, E = scores_TE.shape
    out_TE = torch.empty_like(scores_TE)
    BT, BE = _blocks(E)
    if guard_or_true(T > 0):
        wrap_triton(_route_bwd_kernel)[(triton.cdiv(T, BT),)](
            scores_TE, ids_TK, w_TK, g_w_TK.contiguous(), g_s_TE.contiguous() if g_s_TE is not None else scores_TE,
            out_TE, T, E, K=ids_TK.shape[1], SIGMOID=sigmoid, NORM=norm, HAS_GS=g_s_TE is not None, BT=BT, BE=BE,
            num_warps=4)
    return out_TE


def limit_groups(choice_TE: torch.Tensor, groups: int, limited: int) -> torch.Tensor:
    """``choice_TE`` with the experts outside each row's top ``limited`` of ``groups`` groups masked (-inf)."""
    T, E = choice_TE.shape
    grouped_TGe = choice_TE.view(T, groups, E // groups)
    group_scores_TG = grouped_TGe.topk(min(2, E // groups), dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_scores_TG.topk(limited, dim=-1).indices, True)
    return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


def topk_route_reference(logits_TE: torch.Tensor, bias_E: torch.Tensor, keep_T: Optional[torch.Tensor], K: int,
                         sigmoid: bool, norm: bool, flag: int, groups: Optional[int] = None,
                         limited: Optional[int] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature and results as :func:`topk_route_triton` (ties and NaN: the module docstring);
    ``groups``: group-limited routing."""
    T, E = logits_TE.shape
    scores_TE = torch.sigmoid(logits_TE) if sigmoid else torch.softmax(logits_TE, dim=-1)
    choice_TE = scores_TE + bias_E
    if groups is not None:
        choice_TE = limit_groups(choice_TE, groups, limited or groups)
    ids_TK = torch.topk(choice_TE, K, dim=-1).indices
    w_TK = scores_TE.gather(1, ids_TK)
    if norm:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    nan_TE = logits_TE - logits_TE  # 0 where finite, NaN where not
    ones_TK = torch.ones_like(ids_TK)
    if keep_T is not None:
        ones_TK = ones_TK * keep_T.unsqueeze(1)
        nan_TE = torch.where(keep_T.unsqueeze(1), nan_TE, 0.0)
    counts_E = torch.zeros(E, dtype=torch.int64, device=logits_TE.device).scatter_add_(0, ids_TK.view(-1),
                                                                                       ones_TK.view(-1))
    bad = torch.where(nan_TE.sum() == 0, 0, flag).view(1)
    return ids_TK, w_TK, scores_TE, torch.cat([counts_E, bad])


def topk_route_backward_reference(scores_TE: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                                  g_w_TK: torch.Tensor, g_s_TE: Optional[torch.Tensor], sigmoid: bool,
                                  norm: bool) -> torch.Tensor:
    """Plain torch, same signature and result as :func:`topk_route_backward_triton`."""
    dp_TK = g_w_TK
    if norm:
        chosen_T1 = scores_TE.gather(1, ids_TK).sum(dim=-1, keepdim=True) + 1e-20
        dp_TK = (g_w_TK - (g_w_TK * w_TK).sum(dim=-1, keepdim=True)) / chosen_T1
    g_TE = torch.zeros_like(scores_TE).scatter_add_(1, ids_TK, dp_TK)
    if g_s_TE is not None:
        g_TE = g_TE + g_s_TE
    if sigmoid:
        return g_TE * (1.0 - scores_TE) * scores_TE
    return scores_TE * (g_TE - (g_TE * scores_TE).sum(dim=-1, keepdim=True))


def topk_route(logits_TE: torch.Tensor, bias_E: torch.Tensor, keep_T: Optional[torch.Tensor], K: int, sigmoid: bool,
               norm: bool, flag: int, groups: Optional[int] = None, limited: Optional[int] = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids_TK, weights_TK, scores_TE, tally)`` (the module docstring): ``logits_TE`` fp32 ``(T, E)``,
    ``bias_E`` fp32 (steers the choice only), ``keep_T`` bool ``(T,)`` or ``None``, ``K`` top-k, ``sigmoid``
    (else softmax), ``norm``, ``flag`` the int the tally's last entry takes for a non-finite logit, ``groups`` /
    ``limited`` group-limited routing (``None``: off). Returns int64 ``(T, K)``, fp32 ``(T, K)``, fp32 ``(T, E)``,
    int64 ``(E + 1,)``. The Triton kernel on CUDA (no groups), the reference elsewhere."""
    kernel = groups is None and use_triton("topk_route", logits_TE)
    return (topk_route_triton if kernel else topk_route_reference)(logits_TE, bias_E, keep_T, K, sigmoid, norm, flag,
                                                                    groups, limited)


def topk_route_backward(scores_TE: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, g_w_TK: torch.Tensor,
                        g_s_TE: Optional[torch.Tensor], sigmoid: bool, norm: bool) -> torch.Tensor:
    """The logits' gradient, fp32 ``(T, E)`` (the module docstring), from the forward's ``scores_TE``, ``ids_TK``
    and ``w_TK`` (the weights it returned), the weights' gradient ``g_w_TK`` fp32 ``(T, K)`` and the scores'
    ``g_s_TE`` fp32 ``(T, E)`` or ``None``. The Triton kernel on CUDA, the reference elsewhere."""
    impl = topk_route_backward_triton if use_triton("topk_route", scores_TE) else topk_route_backward_reference
    return impl(scores_TE, ids_TK, w_TK, g_w_TK, g_s_TE, sigmoid, norm)
