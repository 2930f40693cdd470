"""The grouped GEMM seam: ``y[rows of group g] = x[rows] @ w[g].T``.

Legend: ``M`` rows, ``I`` input (reduction) dim, ``O`` output dim, ``e`` groups
(not ``K``/``N``: in MoE code those are top-k and routed copies).

On aligned shapes this is ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm``
on torch 2.11) with the device-resident group offsets: no host sync, no
token-group padding (bf16 needs none: measured on H200, padding groups to 16 rows gains nothing). torch's kernels need every
row stride to be a multiple of 16 bytes; other shapes (toy dims) take a
per-group ``mm`` loop that needs the group sizes on the host: free when the
dispatcher already has them (the all-to-all's one sync), otherwise one
counted device-to-host copy. Under ``torch.compile`` torch's grouped GEMM
traces in bf16 only (its meta function refuses other dtypes), and host sizes
would be data-dependent, so other dtypes and shapes take a masked loop: one
dense GEMM per group over rows zeroed outside the group (``e`` times the
FLOPs; meant for fp32 debugging and CPU tests, not for speed).
The FP8 path plugs in here later.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..host import to_host

__all__ = ["grouped_mm", "native_grouped_mm_ok"]

_native = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch's grouped GEMM
    backward rejects expanded (stride-0) gradients such as ``y.sum()``'s. It returns
    ``y`` itself (marked dirty: the GEMM's fresh output, saved by nobody) rather than a
    view, so an FSDP2 unit ending in it (the routed experts) returns a plain tensor."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def native_grouped_mm_ok(x_MI: torch.Tensor, w_eOI: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands (dtype and 16-byte strides)."""
    size = x_MI.element_size()
    return (
        _native is not None
        and x_MI.dtype in _DTYPES
        and w_eOI.dtype == x_MI.dtype
        and (w_eOI.shape[-1] * size) % 16 == 0
        and (w_eOI.shape[-2] * size) % 16 == 0
    )


def grouped_mm(
    x_MI: torch.Tensor, w_eOI: torch.Tensor, offsets_e: torch.Tensor, sizes: Optional[list[int]] = None
) -> torch.Tensor:
    """Rows ``[offsets[g-1], offsets[g])`` of ``x`` times ``w[g].T``; differentiable.

    ``offsets_e`` is int32 on ``x``'s device; rows past its last entry (the
    tail of a capacity-sized buffer) are never read, and their output rows are
    unspecified (torch's kernel leaves them uninitialised; the fallback writes
    zeros). ``sizes``: the group sizes on the host, if known (used by the fallback).
    """
    compiling = torch.compiler.is_compiling()
    if native_grouped_mm_ok(x_MI, w_eOI) and (x_MI.dtype == torch.bfloat16 or not compiling):
        y_MO = _native(x_MI.contiguous(), w_eOI.transpose(-2, -1), offs=offsets_e)
        return _ContiguousGrad.apply(y_MO) if y_MO.requires_grad else y_MO
    if compiling:
        return _masked_loop(x_MI, w_eOI, offsets_e)
    if sizes is None:
        ends = to_host(offsets_e)
        sizes = [b - a for a, b in zip([0, *ends[:-1]], ends)]
    parts, start = [], 0
    for g, rows in enumerate(sizes):  # empty groups too: their weight gradient is a zero, not None
        parts.append(x_MI[start : start + rows] @ w_eOI[g].transpose(0, 1))
        start += rows
    if start < x_MI.shape[0] or not parts:  # a capacity-sized buffer: its tail stays out of the GEMMs
        parts.append(x_MI.new_zeros((x_MI.shape[0] - start, w_eOI.shape[-2])))
    return torch.cat(parts)


def _masked_loop(x_MI: torch.Tensor, w_eOI: torch.Tensor, offsets_e: torch.Tensor) -> torch.Tensor:
    """Sync-free, shape-static grouped GEMM: ``sum_g mask_g(x) @ w[g].T`` (rows past the last offset: zero).
    Rows are zeroed before the GEMM, so a capacity buffer's tail (NaN) reaches no gradient."""
    group_M = torch.searchsorted(offsets_e, torch.arange(x_MI.shape[0], device=x_MI.device, dtype=offsets_e.dtype),
                                 right=True).unsqueeze(1)
    y_MO = x_MI.new_zeros((x_MI.shape[0], w_eOI.shape[-2]))
    for g in range(w_eOI.shape[0]):
        y_MO = y_MO + torch.where(group_M == g, x_MI, 0.0) @ w_eOI[g].transpose(0, 1)
    return y_MO
