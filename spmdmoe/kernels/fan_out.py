"""Fan-out of rows: ``out[index[s, j]] = w[s, j] * src[s]``, and optionally ``dots[s, j] = <src[s], other[index[s, j]]>``.

Legend: ``S`` source rows, ``J`` copies per source row, ``R`` output rows
(``R >= S*J``), ``D`` row width.

``index_SJ`` must name ``S*J`` distinct output rows (a permutation when
``R == S*J``): every output row is written by exactly one program, so the
kernel is deterministic with no atomics. Output rows no index names (a
capacity-sized ``out``, ``R > S*J``) are zero. The product is taken in fp32
and rounded once to the output dtype (``src``'s); without weights the copy is
exact. ``dots`` accumulate in fp32. (fp64 rows take the reference, in fp64.)

Uses: the MoE dispatch permute (``x_TD`` into ``K`` expert-major copies,
``J = K``, no weights), the EP source-major -> expert-major permutation
(``J = 1``), and the weighted combine's backward (the gradient rows of ``y``
with the routing weights, and the weights' gradient as the dots with ``y``).
Its backward, a sum over the ``J`` copies, is :mod:`spmdmoe.kernels.gather_sum`.

Measured (H200, torch 2.11, Triton 3.6, bf16, T=16,384, K=6, D=2048; ``benchmarks/kernels.py``):
the dispatch fan-out 0.139 ms, 3.38 TB/s (80 % of the 4.2 TB/s copy ceiling); the combine
backward with dots 0.275 ms, 3.18 TB/s (76 %); :func:`fan_out_fp8` (the dispatch fan-out plus the e4m3
rows, bytes = bf16 read + bf16 and e4m3 copies and scales written) 0.214 ms, 3.14 TB/s (75 %), 1.68x the
fan-out followed by the rowwise quantizer on the copies (0.360 ms).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import triton_op, wrap_triton

from .backend import use_triton
from .fp8_common import EPS_C, FP8, e4m3_inverse, e4m3_scale, to_e4m3
from .fp8_rows import quantize_rows_reference

__all__ = ["fan_out", "fan_out_fp8", "fan_out_fp8_reference", "fan_out_fp8_triton", "fan_out_reference",
           "fan_out_triton"]


@triton.jit
def _fan_out_kernel(
    src_ptr, index_ptr, w_ptr, other_ptr, out_ptr, dots_ptr, q_ptr, qs_ptr, D, stride_src, stride_other, stride_out,
    J: tl.constexpr, HAS_W: tl.constexpr, HAS_DOT: tl.constexpr, QUANT: tl.constexpr, COPIES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    if QUANT:  # the source row's amax first (its second read comes from L1/L2), then K copies of its e4m3
        amax = tl.full([], EPS_C, tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            v = tl.load(src_ptr + s * stride_src + offs, mask=offs < D, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
        inv, scale = e4m3_inverse(amax), e4m3_scale(amax)
    for j in tl.static_range(J):
        r = tl.load(index_ptr + s * J + j).to(tl.int64)
        if QUANT:
            tl.store(qs_ptr + r, scale)
        if HAS_W:
            w = tl.load(w_ptr + s * J + j).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = offs < D
            v = tl.load(src_ptr + s * stride_src + offs, mask=m, other=0.0)
            if HAS_W:
                tl.store(out_ptr + r * stride_out + offs, (v.to(tl.float32) * w).to(out_ptr.dtype.element_ty), mask=m)
            elif COPIES:
                tl.store(out_ptr + r * stride_out + offs, v, mask=m)
            if QUANT:
                q = to_e4m3(v.to(tl.float32), inv)
                tl.store(q_ptr + r * D + offs, q.to(q_ptr.dtype.element_ty), mask=m)
            if HAS_DOT:
                y = tl.load(other_ptr + r * stride_other + offs, mask=m, other=0.0)
                acc += v.to(tl.float32) * y.to(tl.float32)
        if HAS_DOT:
            tl.store(dots_ptr + s * J + j, tl.sum(acc, axis=0))


# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_d": 2048, "num_warps": 8}


def _output(src_SD: torch.Tensor, rows: int, copies: int) -> torch.Tensor:
    """The ``(rows, D)`` output: zeros where no copy lands (``rows > copies``; unknown under compile: zeros)."""
    make = torch.zeros if guard_or_true(rows > copies) else torch.empty
    return make((rows, src_SD.shape[1]), dtype=src_SD.dtype, device=src_SD.device)


def _block_d(D: int) -> int:
    return max(16, min(triton.next_power_of_2(max(D, 1)), CONFIG["block_d"]))


@triton_op("spmdmoe::fan_out", mutates_args=())
def fan_out_triton(
    src_SD: torch.Tensor, index_SJ: torch.Tensor, rows: int,
    weights_SJ: Optional[torch.Tensor] = None, other_RD: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher (see the module docstring); ``dots`` is empty without ``other_RD``."""
    S, J = index_SJ.shape
    D = src_SD.shape[1]
    src_SD = src_SD.contiguous()
    index_SJ = index_SJ.contiguous()
    out_RD = _output(src_SD, rows, S * J)
    dots_SJ = torch.empty((S, J) if other_RD is not None else (0, J), dtype=torch.float32, device=src_SD.device)
    w = weights_SJ.contiguous() if weights_SJ is not None else index_SJ
    other = other_RD.contiguous() if other_RD is not None else src_SD
    if S > 0 and D > 0:
        wrap_triton(_fan_out_kernel)[(S,)](
            src_SD, index_SJ, w, other, out_RD, dots_SJ, out_RD, dots_SJ, D, src_SD.stride(0), other.stride(0),
            out_RD.stride(0), J=J, HAS_W=weights_SJ is not None, HAS_DOT=other_RD is not None, QUANT=False,
            COPIES=True, BLOCK_D=_block_d(D), num_warps=CONFIG["num_warps"],
        )
    return out_RD, dots_SJ


@triton_op("spmdmoe::fan_out_fp8", mutates_args=())
def fan_out_fp8_triton(src_SD: torch.Tensor, index_SJ: torch.Tensor, rows: int, copies: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out_RD, q_RD e4m3, s_R fp32)``: the copies (no weights) and, from the same read of each source row,
    its rowwise e4m3 (:mod:`spmdmoe.kernels.fp8_rows`' rule) in the same ``J`` slots: quantized once per
    source row, bit for bit what :func:`spmdmoe.kernels.quantize_rows` makes of ``out_RD``. Rows no index
    names: ``out`` zero, ``q`` and ``s`` unspecified. ``copies=False``: the e4m3 only (``out_RD`` empty,
    ``(0, D)``), for a caller that made the bf16 copies earlier and freed them."""
    S, J = index_SJ.shape
    D = src_SD.shape[1]
    src_SD = src_SD.contiguous()
    index_SJ = index_SJ.contiguous()
    out_RD = _output(src_SD, rows, S * J) if copies else src_SD.new_empty((0, D))
    q_RD = torch.empty((rows, D), dtype=FP8, device=src_SD.device)
    s_R = torch.empty((rows,), dtype=torch.float32, device=src_SD.device)
    if S > 0 and D > 0:
        wrap_triton(_fan_out_kernel)[(S,)](
            src_SD, index_SJ, index_SJ, src_SD, out_RD, s_R, q_RD, s_R, D, src_SD.stride(0), src_SD.stride(0),
            out_RD.stride(0), J=J, HAS_W=False, HAS_DOT=False, QUANT=True, COPIES=copies, BLOCK_D=_block_d(D),
            num_warps=CONFIG["num_warps"],
        )
    return out_RD, q_RD, s_R


def fan_out_fp8_reference(src_SD: torch.Tensor, index_SJ: torch.Tensor, rows: int, copies: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature as :func:`fan_out_fp8_triton` (rows no index names: all zero)."""
    S, J = index_SJ.shape
    out_RD = fan_out_reference(src_SD, index_SJ, rows)[0] if copies else src_SD.new_empty((0, src_SD.shape[1]))
    q_SD, s_S = quantize_rows_reference(src_SD)
    flat = index_SJ.reshape(-1)
    q_RD = torch.zeros((rows, src_SD.shape[1]), dtype=torch.uint8, device=src_SD.device)
    q_RD.index_copy_(0, flat, q_SD.view(torch.uint8).repeat_interleave(J, dim=0))
    s_R = s_S.new_zeros(rows).index_copy_(0, flat, s_S.repeat_interleave(J))
    return out_RD, q_RD.view(FP8), s_R


def fan_out_fp8(src_SD: torch.Tensor, index_SJ: torch.Tensor, rows: int, copies: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the reference elsewhere (``spmdmoe.kernels.backend``)."""
    impl = fan_out_fp8_triton if use_triton("fan_out", src_SD) else fan_out_fp8_reference
    return impl(src_SD, index_SJ, rows, copies)


def fan_out_reference(
    src_SD: torch.Tensor, index_SJ: torch.Tensor, rows: int,
    weights_SJ: Optional[torch.Tensor] = None, other_RD: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same signature and semantics as :func:`fan_out_triton`."""
    S, J = index_SJ.shape
    D = src_SD.shape[1]
    acc = torch.promote_types(src_SD.dtype, torch.float32)  # fp32, fp64 for fp64
    copies = src_SD.unsqueeze(1).expand(S, J, D)
    if weights_SJ is not None:
        copies = (copies.to(acc) * weights_SJ.to(acc).unsqueeze(-1)).to(src_SD.dtype)
    out_RD = _output(src_SD, rows, S * J)
    out_RD.index_copy_(0, index_SJ.reshape(-1), copies.reshape(S * J, D))
    if other_RD is None:
        return out_RD, torch.empty((0, J), dtype=acc, device=src_SD.device)
    picked_SJD = other_RD.index_select(0, index_SJ.reshape(-1)).view(S, J, D)
    return out_RD, torch.bmm(picked_SJD.to(acc), src_SD.to(acc).unsqueeze(-1)).squeeze(-1)


def fan_out(
    src_SD: torch.Tensor, index_SJ: torch.Tensor, rows: int,
    weights_SJ: Optional[torch.Tensor] = None, other_RD: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the reference elsewhere (``spmdmoe.kernels.backend``)."""
    impl = fan_out_triton if use_triton("fan_out", src_SD) else fan_out_reference
    return impl(src_SD, index_SJ, rows, weights_SJ, other_RD)
