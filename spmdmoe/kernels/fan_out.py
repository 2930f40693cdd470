"""Fan-out of rows: ``out[index[s, j]] = w[s, j] * src[s]``, and optionally ``dots[s, j] = <src[s], other[index[s, j]]>``.

Legend: ``M`` source rows, ``J`` copies per source row, ``R`` output rows,
``D`` row width.

``index_MJ`` names distinct output rows (a permutation when ``R == M*J``), or
``-1``: that copy is skipped (nothing written, its dot is 0; DeepEP's
convention). Every output row is written by at most one program, so the
kernel is deterministic with no atomics. Output rows no index names are zero
when ``R > M*J`` (a capacity-sized ``out``); with skipped copies and
``R <= M*J`` they are unspecified (the EP transports never read them). The product is taken in fp32
and rounded once to the output dtype (``src``'s); without weights the copy is
exact. ``dots`` accumulate in fp32. (fp64 rows take the reference, in fp64.)

Uses: the MoE dispatch permute (a rank's rows, its own or received, into their
expert-major copies, ``J = K``, ``-1`` for another rank's expert), the EP send
buffers (a token into the slot of each rank it visits, ``J = n``), and the
weighted combine's backward (the gradient rows of ``y`` with the routing
weights, and the weights' gradient as the dots with ``y``).
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
from torch.fx.experimental.symbolic_shapes import guard_or_true, statically_known_true
from torch.library import wrap_triton

from .backend import by_backend, cast, kernel_op, unit_rows
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
        keep = r >= 0  # -1: a skipped copy
        if QUANT:
            tl.store(qs_ptr + r, scale, mask=keep)
        if HAS_W:
            w = tl.load(w_ptr + s * J + j).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = offs < D
            v = tl.load(src_ptr + s * stride_src + offs, mask=m, other=0.0)
            m = m & (offs * 0 + r >= 0)  # & keep, as a vector (Triton's interpreter refuses a scalar & vector mask)
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
        if HAS_DOT:  # a skipped copy's dot is 0 (not sum(v * 0), NaN for an inf in the row)
            tl.store(dots_ptr + s * J + j, tl.where(keep, tl.sum(acc, axis=0), 0.0))


# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_d": 2048, "num_warps": 8}


def _output(src_MD: torch.Tensor, rows: int, copies: int) -> torch.Tensor:
    """The ``(rows, D)`` output: zeros where no copy lands (``rows > copies``; under compile, unless provably
    not: no guard on the token counts, which would recompile when their order flips). Data-dependent counts
    (the sync EP transport's, read from the count exchange) are provably not when the caller has stated
    ``torch._check(rows <= copies)``: ``AllToAllTransport.launch_dispatch`` does, and its compiled step fills no
    row buffer (the fills took 2.5 ms of GPU time per EP 4 step at 16k tokens on H100s, issue 41)."""
    make = torch.empty if statically_known_true(rows <= copies) else torch.zeros
    return make((rows, src_MD.shape[1]), dtype=src_MD.dtype, device=src_MD.device)


def _or_dump(index_MJ: torch.Tensor, rows: int) -> torch.Tensor:
    """The flat index with each skipped copy (``-1``) sent to row ``rows``, one past the output (the references
    write there and drop it)."""
    flat = index_MJ.reshape(-1)
    return torch.where(flat >= 0, flat, rows)


def _block_d(D: int) -> int:
    return max(16, min(triton.next_power_of_2(max(D, 1)), CONFIG["block_d"]))


@kernel_op("spmdmoe::fan_out", mutates_args=())
def fan_out_triton(
    src_MD: torch.Tensor, index_MJ: torch.Tensor, rows: int,
    weights_MJ: Optional[torch.Tensor] = None, other_RD: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher (see the module docstring); ``dots`` is empty without ``other_RD``."""
    M, J = index_MJ.shape
    D = src_MD.shape[1]
    src_MD = unit_rows(src_MD)
    index_MJ = index_MJ.contiguous()
    out_RD = _output(src_MD, rows, M * J)
    dots_MJ = torch.empty((M, J) if other_RD is not None else (0, J), dtype=torch.float32, device=src_MD.device)
    w = weights_MJ.contiguous() if weights_MJ is not None else index_MJ
    other = other_RD.contiguous() if other_RD is not None else src_MD
    # q_ptr / qs_ptr are unused (QUANT=False: never written); they get dots_MJ, so the output sits in one slot only
    if guard_or_true(M > 0) and D > 0:  # M: data-dependent under compile (EP); an empty grid launches nothing
        wrap_triton(_fan_out_kernel)[(M,)](
            src_MD, index_MJ, w, other, out_RD, dots_MJ, dots_MJ, dots_MJ, D, src_MD.stride(0), other.stride(0),
            out_RD.stride(0), J=J, HAS_W=weights_MJ is not None, HAS_DOT=other_RD is not None, QUANT=False,
            COPIES=True, BLOCK_D=_block_d(D), num_warps=CONFIG["num_warps"],
        )
    return out_RD, dots_MJ


@kernel_op("spmdmoe::fan_out_fp8", mutates_args=())
def fan_out_fp8_triton(src_MD: torch.Tensor, index_MJ: torch.Tensor, rows: int, copies: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out_RD, q_RD e4m3, s_R fp32)``: the copies (no weights) and, from the same read of each source row,
    its rowwise e4m3 (:mod:`spmdmoe.kernels.fp8_rows`' rule) in the same ``J`` slots: quantized once per
    source row, bit for bit what :func:`spmdmoe.kernels.quantize_rows` makes of ``out_RD``. Rows no index
    names: ``out`` as :func:`fan_out_triton`'s (zero past ``M*J`` rows, else unspecified), ``q`` and ``s``
    unspecified. ``copies=False``: the e4m3 only (``out_RD`` empty,
    ``(0, D)``), for a caller that made the bf16 copies earlier and freed them."""
    M, J = index_MJ.shape
    D = src_MD.shape[1]
    src_MD = unit_rows(src_MD)
    index_MJ = index_MJ.contiguous()
    out_RD = _output(src_MD, rows, M * J) if copies else src_MD.new_empty((0, D))
    q_RD = torch.empty((rows, D), dtype=FP8, device=src_MD.device)
    s_R = torch.empty((rows,), dtype=torch.float32, device=src_MD.device)
    if guard_or_true(M > 0) and D > 0:  # M: data-dependent under compile (EP); an empty grid launches nothing
        wrap_triton(_fan_out_kernel)[(M,)](
            src_MD, index_MJ, index_MJ, src_MD, out_RD, s_R, q_RD, s_R, D, src_MD.stride(0), src_MD.stride(0),
            out_RD.stride(0), J=J, HAS_W=False, HAS_DOT=False, QUANT=True, COPIES=copies, BLOCK_D=_block_d(D),
            num_warps=CONFIG["num_warps"],
        )
    return out_RD, q_RD, s_R


def fan_out_fp8_reference(src_MD: torch.Tensor, index_MJ: torch.Tensor, rows: int, copies: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature as :func:`fan_out_fp8_triton` (rows no index names: zero here)."""
    M, J = index_MJ.shape
    out_RD = fan_out_reference(src_MD, index_MJ, rows)[0] if copies else src_MD.new_empty((0, src_MD.shape[1]))
    q_MD, s_M = quantize_rows_reference(src_MD)
    flat = _or_dump(index_MJ, rows)
    q_RD = torch.zeros((rows + 1, src_MD.shape[1]), dtype=torch.uint8, device=src_MD.device).index_copy(
        0, flat, q_MD.view(torch.uint8).repeat_interleave(J, dim=0))[:rows]  # out of place, as fan_out_reference
    s_R = s_M.new_zeros(rows + 1).index_copy(0, flat, s_M.repeat_interleave(J))[:rows]
    return out_RD, q_RD.view(FP8), s_R


fan_out_fp8 = by_backend("fan_out", fan_out_fp8_triton, fan_out_fp8_reference)


def fan_out_reference(
    src_MD: torch.Tensor, index_MJ: torch.Tensor, rows: int,
    weights_MJ: Optional[torch.Tensor] = None, other_RD: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same signature and semantics as :func:`fan_out_triton`."""
    M, J = index_MJ.shape
    D = src_MD.shape[1]
    acc = torch.promote_types(src_MD.dtype, torch.float32)  # fp32, fp64 for fp64
    copies = src_MD.unsqueeze(1).expand(M, J, D)
    if weights_MJ is not None:
        copies = cast(copies.to(acc) * weights_MJ.to(acc).unsqueeze(-1), src_MD.dtype)
    # out of place (index_copy, not index_copy_): an autograd.Function's forward runs this (backend.cast);
    # a skipped copy (-1) lands in one more row, dropped
    flat = _or_dump(index_MJ, rows)
    out_RD = torch.cat([_output(src_MD, rows, M * J), src_MD.new_empty((1, D))]).index_copy(
        0, flat, copies.reshape(M * J, D))[:rows]
    if other_RD is None:
        return out_RD, torch.empty((0, J), dtype=acc, device=src_MD.device)
    picked_MJD = other_RD.index_select(0, index_MJ.reshape(-1).clamp(min=0)).view(M, J, D)
    dots_MJ = torch.bmm(picked_MJD.to(acc), src_MD.to(acc).unsqueeze(-1)).squeeze(-1)
    return out_RD, torch.where(index_MJ >= 0, dots_MJ, 0)


fan_out = by_backend("fan_out", fan_out_triton, fan_out_reference)
