"""The grouped GEMM seam: ``y[rows of group g] = x[rows] @ w[g].T``.

Legend: ``M`` rows, ``I`` input (reduction) dim, ``O`` output dim, ``e`` groups, ``F`` the experts'
hidden dim (``h13`` is ``2F`` wide) (not ``K``/``N``: in MoE code those are top-k and routed copies).

On aligned shapes this is ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on torch 2.11) with the
device-resident group offsets: no host sync, no token-group padding (bf16 needs none: measured on H200, padding groups
to 16 rows gains nothing). torch's kernels need every row stride to be a multiple of 16 bytes; other shapes (toy dims)
take a per-group ``mm`` loop that needs the group sizes on the host: free when the dispatcher already has them (the
all-to-all's one sync), otherwise one counted device-to-host copy. Under ``torch.compile`` torch's grouped GEMM traces
in bf16 only (its meta function refuses other dtypes), and host sizes would be data-dependent, so other dtypes and
shapes take a masked loop: one dense GEMM per group over rows zeroed outside the group (``e`` times the FLOPs; meant for
fp32 debugging and CPU tests, not for speed). The FP8 experts' GEMMs are ``moe/experts/fp8.py``'s
(``torch._scaled_grouped_mm``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ...host import to_host

__all__ = ["grouped_mm", "grouped_mm_pair", "native_grouped_mm_ok", "joined", "up_weights"]

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
    """Whether torch's grouped GEMM takes these operands (dtype and 16-byte strides; under
    ``torch.compile`` bf16 only, as its meta function refuses other dtypes)."""
    size = x_MI.element_size()
    return (
        _native is not None
        and (x_MI.dtype in _DTYPES if not torch.compiler.is_compiling() else x_MI.dtype == torch.bfloat16)
        and w_eOI.dtype == x_MI.dtype
        and (w_eOI.shape[-1] * size) % 16 == 0
        and (w_eOI.shape[-2] * size) % 16 == 0
    )


def grouped_mm(
    x_MI: torch.Tensor, w_eOI: torch.Tensor, offsets_e: torch.Tensor, sizes: Optional[list[int]] = None,
    dense_grad: bool = False,
) -> torch.Tensor:
    """Rows ``[offsets[g-1], offsets[g])`` of ``x`` times ``w[g].T``; differentiable.

    ``offsets_e`` is int32 on ``x``'s device; rows past its last entry (the tail of a capacity-sized buffer) are never
    read, and their output rows are unspecified (torch's kernel leaves them uninitialised; the fallback writes zeros).
    ``sizes``: the group sizes on the host, if known (used by the fallback). ``dense_grad``: the caller's next op
    makes the output's gradient contiguous itself (else a node of its own does: :class:`_ContiguousGrad`).
    """
    if native_grouped_mm_ok(x_MI, w_eOI):
        y_MO = _native(x_MI.contiguous(), w_eOI.transpose(-2, -1), offs=offsets_e)
        return _ContiguousGrad.apply(y_MO) if y_MO.requires_grad and not dense_grad else y_MO
    if torch.compiler.is_compiling():
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
    """Sync-free, shape-static grouped GEMM: ``sum_g mask_g(mask_g(x) @ w[g].T)`` (rows past the last offset:
    zero). The rows are masked before each GEMM and its output after it, so neither a capacity buffer's tail
    (uninitialised: NaN at times) nor the gradient arriving for those rows reaches a weight gradient (``0 * NaN``
    is NaN: masking ``x`` alone let a NaN in the incoming gradient's tail into ``w``'s, under inductor on NCCL)."""
    group_M = torch.searchsorted(offsets_e, torch.arange(x_MI.shape[0], device=x_MI.device, dtype=offsets_e.dtype),
                                 right=True).unsqueeze(1)
    y_MO = x_MI.new_zeros((x_MI.shape[0], w_eOI.shape[-2]))
    for g in range(w_eOI.shape[0]):
        mine = group_M == g
        y_MO = y_MO + torch.where(mine, torch.where(mine, x_MI, 0.0) @ w_eOI[g].transpose(0, 1), 0.0)
    return y_MO


def plain_tensor(t: torch.Tensor) -> bool:
    """A tensor or parameter with its own strided storage (not a DTensor or another subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _packed_offset(w1_eFI: torch.Tensor, w3_eFI: torch.Tensor) -> Optional[int]:
    """``w1``'s storage offset when ``w3`` sits right after it in the same storage, else ``None``.
    Under ``torch.compile`` a constant of the trace, read from the real parameters: Dynamo recompiles
    when their strides change (``unpack``; tested in ``tests/test_compile_moe.py``). A ``.data`` swap that
    keeps the packed strides but breaks the adjacency is not guarded (nothing in spmdmoe does that)."""
    if not (plain_tensor(w1_eFI) and plain_tensor(w3_eFI)):
        return None
    e, F, I = w1_eFI.shape
    stride = (2 * F * I, I, 1)
    if (w3_eFI.shape != w1_eFI.shape or w1_eFI.stride() != stride or w3_eFI.stride() != stride
            or w1_eFI.dtype != w3_eFI.dtype or not torch._C._is_alias_of(w1_eFI, w3_eFI)
            or w3_eFI.storage_offset() != w1_eFI.storage_offset() + F * I):
        return None
    return int(w1_eFI.storage_offset())


# torch.compiler.assume_constant_result(_packed_offset), without the import of Dynamo that the call makes (a second
# of every process's `import spmdmoe`): the mark is this attribute (tests/test_private_apis.py)
_packed_offset._dynamo_marked_constant = True  # type: ignore[attr-defined]


def joined(w1_eFI: torch.Tensor, w3_eFI: torch.Tensor) -> Optional[torch.Tensor]:
    """``[w1 | w3]`` along the output dim as a view, when ``w3`` sits right after ``w1`` in one storage
    (``GroupedExperts`` allocates them so); ``None`` otherwise. Traceable by ``torch.compile``."""
    offset = _packed_offset(w1_eFI, w3_eFI)
    if offset is None:
        return None
    e, F, I = w1_eFI.shape
    return w1_eFI.as_strided((e, 2 * F, I), (2 * F * I, I, 1), offset)


def up_weights(w1_eFI: torch.Tensor, w3_eFI: torch.Tensor) -> torch.Tensor:
    """``[w1 | w3]`` as ``(e, 2F, I)``: the packed view (:func:`joined`), else a copy."""
    w13 = joined(w1_eFI, w3_eFI)
    return w13 if w13 is not None else torch.cat([w1_eFI, w3_eFI], dim=1)


class _UpProjection(torch.autograd.Function):
    """``[x @ w1[g].T | x @ w3[g].T]`` per group as ONE grouped GEMM on ``[w1 | w3]``: the backward's input
    gradient is one GEMM too (no sum of two GEMMs' outputs); the weights' gradients are two, made here, or,
    given ``later`` (``wgrad_later.LaterWgrad``; ``w1`` and ``w3`` then come detached), by its anchor."""

    @staticmethod
    def forward(ctx: Any, x_MI: torch.Tensor, w1_eFI: torch.Tensor, w3_eFI: torch.Tensor,  # type: ignore[override]
                offsets_e: torch.Tensor, later: Any = None, token: Optional[torch.Tensor] = None) -> torch.Tensor:
        w13 = up_weights(w1_eFI, w3_eFI)
        x_MI = x_MI.contiguous()
        ctx.save_for_backward(x_MI, w13, offsets_e)
        ctx.later = later
        return _native(x_MI, w13.transpose(-2, -1), offs=offsets_e)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_M2F: torch.Tensor) -> Any:  # type: ignore[override]
        x_MI, w13, offsets_e = ctx.saved_tensors
        g_M2F = g_M2F.contiguous()
        dx = _native(g_M2F, w13, offs=offsets_e) if ctx.needs_input_grad[0] else None
        if ctx.later is not None:
            return dx, None, None, None, None, ctx.later.hold(g_M2F, x_MI, offsets_e)
        return (dx, *up_weight_grads(g_M2F, x_MI, offsets_e, ctx.needs_input_grad[1:3]), None, None, None)


def up_weight_grads(g_M2F: torch.Tensor, x_MI: torch.Tensor, offsets_e: torch.Tensor, needs: tuple[bool, bool]
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dw1, dw3)``, ``(e, F, I)`` each (``None`` where ``needs`` says no), from the up-projection's output
    gradient ``g_M2F`` (contiguous) and its rows ``x_MI``: two grouped GEMMs on column slices of ``g``, each
    result contiguous, as autograd wants a gradient of a non-dense (packed) parameter (a view of one
    ``[dw1 | dw3]`` would be copied)."""
    F = g_M2F.shape[1] // 2
    dw1 = _native(g_M2F[:, :F].transpose(-2, -1), x_MI, offs=offsets_e) if needs[0] else None
    dw3 = _native(g_M2F[:, F:].transpose(-2, -1), x_MI, offs=offsets_e) if needs[1] else None
    return dw1, dw3


def grouped_mm_pair(
    x_MI: torch.Tensor, w1_eFI: torch.Tensor, w3_eFI: torch.Tensor, offsets_e: torch.Tensor,
    sizes: Optional[list[int]] = None, later: Any = None,
) -> torch.Tensor:
    """``[grouped_mm(x, w1) | grouped_mm(x, w3)]``, ``(M, 2F)``: the experts' up-projections.

    On torch's grouped GEMM (bf16 under compile) one GEMM on ``[w1 | w3]`` (a view when the two are adjacent, else a
    copy); measured on H200 at T=16k, K=6: 5.5 ms fwd+bwd for the pair against 6.3 ms as two GEMMs
    (``benchmarks/ARCHIVE.md``). Otherwise two :func:`grouped_mm` concatenated. ``later`` (``wgrad_later.LaterWgrad``,
    made earlier in the forward by the caller): the weights' gradients come from its anchor, after whatever autograd
    runs between the two (torch's grouped GEMM, eager, only; otherwise its anchor gets no gradient and never runs).
    """
    if native_grouped_mm_ok(x_MI, w1_eFI):
        if later is not None and not torch.compiler.is_compiling():  # (the experts compiled alone: one node)
            return _UpProjection.apply(x_MI, w1_eFI.detach(), w3_eFI.detach(), offsets_e, later, later.token)
        return _UpProjection.apply(x_MI, w1_eFI, w3_eFI, offsets_e)
    return torch.cat([grouped_mm(x_MI, w1_eFI, offsets_e, sizes), grouped_mm(x_MI, w3_eFI, offsets_e, sizes)], dim=1)
