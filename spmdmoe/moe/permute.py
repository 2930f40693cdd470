"""Row permutations of the MoE data flow, with gather-only backwards.

Legend: ``T`` tokens, ``K`` top-k, ``N = T*K`` routed copies, ``D`` model dim.

Every move of rows is a gather ``out[m] = src[index[m]]`` whose backward is
again a gather, by the inverse map, followed by a sum over the ``J`` copies
each source row was read into (``J = K`` for the dispatch fan-out, ``J = 1``
for pure permutations). No scatter-add, no atomics: deterministic, in the
source dtype, summed in fp32 (fp64 for fp64). These are the plain-torch references that the
Triton permute kernels (docs/design.md §7) will replace.
"""

from __future__ import annotations

from typing import Any

import torch

from ..autograd import differentiable

__all__ = ["gather_rows", "count_per_expert", "sort_by_expert", "weighted_combine"]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index_M: torch.Tensor, inverse_SJ: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse_SJ)
        return src.index_select(0, index_M)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_M: torch.Tensor) -> Any:  # type: ignore[override]
        (inverse_SJ,) = ctx.saved_tensors
        S, J = inverse_SJ.shape
        if J == 1:
            return grad_M.index_select(0, inverse_SJ.view(-1)), None, None
        picked = grad_M.index_select(0, inverse_SJ.reshape(-1)).view(S, J, *grad_M.shape[1:])
        acc = torch.promote_types(grad_M.dtype, torch.float32)  # fp32 for bf16/fp16, fp64 stays fp64
        return picked.sum(dim=1, dtype=acc).to(grad_M.dtype), None, None


gather_rows = differentiable(_GatherRows, lambda src, index_M, inverse_SJ: src.index_select(0, index_M))
gather_rows.__doc__ = """``src[index_M]``; ``inverse_SJ[s]`` lists the ``J`` output rows that read source row ``s``.

Every source row must be read exactly ``J`` times (a permutation has ``J = 1``).
"""


def count_per_expert(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed copies per expert (int64, on the ids' device): a fixed-size scatter-add, no host sync
    (``torch.bincount`` syncs twice on CUDA to size its output)."""
    ids_N = ids_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device)
    return counts_E.scatter_add_(0, ids_N, torch.ones_like(ids_N))


def sort_by_expert(ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order_N, pos_N, counts_E)``: a stable sort of the routed copies by expert.

    ``order_N[i]`` is the flat ``(t, k)`` index of the i-th copy in expert
    order; ``pos_N`` is its inverse (where copy ``t*K + k`` sits); ``counts_E``
    the copies per expert. All on the ids' device, no host sync.
    """
    ids_N = ids_TK.reshape(-1)
    order_N = torch.argsort(ids_N, stable=True)
    pos_N = torch.empty_like(order_N)
    pos_N.scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
    return order_N, pos_N, count_per_expert(ids_N, num_experts)


class _WeightedSum(torch.autograd.Function):
    """``out[t] = sum_k w[t, k] * y[t, k]``: forward and weight-gradient as batched
    matrix-vector products (fp32 accumulation), the row gradient as a broadcast multiply."""

    @staticmethod
    def forward(ctx: Any, y_TKD: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(y_TKD, w_TK)
        return torch.bmm(w_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_TD: torch.Tensor) -> Any:  # type: ignore[override]
        y_TKD, w_TK = ctx.saved_tensors
        g_TD = g_TD.contiguous()
        grad_y = g_TD.unsqueeze(1) * w_TK.to(g_TD.dtype).unsqueeze(-1) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(y_TKD, g_TD.unsqueeze(-1)).squeeze(-1).to(w_TK.dtype) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w


def weighted_combine(y_ND: torch.Tensor, pos_N: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y[pos[t*K + k]]``, in ``y``'s dtype.

    The sum over K is a batched ``(1, K) @ (K, D)`` product (fp32 accumulation,
    no fp32 copy of the ``N x D`` rows); its backward is a broadcast multiply
    for the rows and a batched matrix-vector product for the weights (no
    scatter, no atomics). The fp32 routing weights are cast to ``y``'s dtype
    (exact for fp32; for bf16 they carry bf16 precision, as the rows do).
    """
    T, K = weights_TK.shape
    y_TKD = gather_rows(y_ND, pos_N, order_N.view(-1, 1)).view(T, K, y_ND.shape[-1])
    if torch.is_grad_enabled() and (y_TKD.requires_grad or weights_TK.requires_grad):
        return _WeightedSum.apply(y_TKD, weights_TK)
    return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)
