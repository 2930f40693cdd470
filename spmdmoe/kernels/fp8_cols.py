"""Per-group columnwise FP8 quantization of the two wgrad operands, in ONE launch, into a 16-row-aligned layout.

Legend: ``R`` rows in the buffer (expert-major, a capacity), ``A`` / ``B`` the
columns of the two operands, ``e`` groups (local experts), ``P`` padded rows.

The weight gradient of an expert is ``a[g]^T @ b[g]`` over the rows of its
group ``g`` (``rows [offsets[g-1], offsets[g])``): ``(grad_out, x)`` of the
up-projection, ``(grad_out, h)`` of the down-projection. ``torch._scaled_grouped_mm``
takes it as a 2-D x 2-D GEMM with the token dim contiguous in both operands
(``a^T`` of shape ``(A, P)``, ``b^T`` of shape ``(B, P)``), every group starting at
a multiple of 16 tokens and the total a multiple of 16, with one scale per
(group, column) over that group's rows only. This kernel writes exactly that:

* ``qa_AP``, ``qb_BP``: e4m3, transposed; group ``g``'s rows start at
  ``padded[g-1]`` (a multiple of 16) and are followed by zero rows up to
  ``padded[g]``; the last group's padding runs to ``P``, so ``padded[-1] == P``;
* ``sa_eA``, ``sb_eB``: the fp32 dequantization factors (scale rule:
  :mod:`spmdmoe.kernels.fp8_common`; an empty group gets the all-zero scale);
* ``padded_e``: the padded group ends (int32, on the device; no host sync).

``P = round_up(R + 15 e, 16)``, a host int fixed by the buffer's shape, so
nothing here depends on the routed counts on the host. This is the only
padding of the FP8 path (forward and dgrad GEMMs take unaligned groups), and
it is written here, by the quantizer: no separate pad or unpad copy. Rows
past ``offsets[-1]`` (a capacity buffer's tail) are never read.

One program per (group, block of ``BLOCK_C`` columns of either operand): it
reads the group's rows twice (amax, then scale and cast, the second pass
backwards so that the rows read last are re-read first, from L2 if they are
still there) and writes them transposed.

Measured (H200, torch 2.11, Triton 3.6, bf16 in, R = 98,304 rows, A = 2048, B = 1408, e = 64;
``benchmarks/kernels.py``; bytes = bf16 read once + e4m3 and scales written): 0.649 ms, 1.58 TB/s
(38 % of 4.2); torchao 0.18's ``triton_fp8_per_group_colwise_scales_dual`` (no 16-row layout): 0.788 ms
(1.30 TB/s); that figure is from before the second pass ran backwards (not yet re-measured). The
second read misses L2 (about 200 KB of rows per program, hundreds resident), so the
real traffic is about 5 bytes per element against the 3 counted; computing the column amax in the
kernels that produce the operands would remove that read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .backend import use_triton
from .fp8_common import EPS_C, FP8, dequant_scale, e4m3_inverse, e4m3_scale, quantize_reference, to_e4m3

__all__ = ["padded_rows", "quantize_cols_pair", "quantize_cols_pair_reference", "quantize_cols_pair_triton"]

ALIGN = 16
# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_r": 128, "block_c": 64, "num_warps": 4}


def padded_rows(R: int, e: int) -> int:
    """``P``: rows of the aligned layout for ``R`` buffer rows in ``e`` groups (host ints only)."""
    return -(-(R + (ALIGN - 1) * e) // ALIGN) * ALIGN


def _padded_ends(offsets_e: torch.Tensor, P: int) -> torch.Tensor:
    """Group ends rounded up to multiples of 16, the last one ``P``: int32, on the device."""
    sizes = torch.diff(offsets_e, prepend=offsets_e.new_zeros(1))
    ends = torch.cumsum((sizes + (ALIGN - 1)) // ALIGN * ALIGN, 0)
    return torch.cat([ends[:-1], ends.new_full((1,), P)]).to(torch.int32)


@triton.jit
def _quantize_group_cols(src_ptr, dst_ptr, s_ptr, C, P, g, c0, start, end, pstart, pend,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Group ``g``'s rows ``[start, end)`` of columns ``[c0, c0 + BLOCK_C)``: column amax, then the e4m3 values
    written transposed at ``dst_ptr + col * P + (row - start + pstart)``, zero rows up to ``pend``."""
    cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
    cmask = cols < C
    rr = tl.arange(0, BLOCK_R)
    amax = tl.full([BLOCK_C], EPS_C, tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + rr
        m = (rows < end)[:, None] & cmask[None, :]
        x = tl.load(src_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    inv = e4m3_inverse(amax)
    tl.store(s_ptr + g * C + cols, e4m3_scale(amax), mask=cmask)
    shift = pstart - start
    # the second pass walks the rows backwards: the ones read last by the first pass are likeliest still in L2
    chunks = tl.cdiv(end - start, BLOCK_R)
    for i in range(0, chunks):
        rows = start + (chunks - 1 - i) * BLOCK_R + rr
        m = (rows < end)[:, None] & cmask[None, :]
        x = tl.load(src_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        q = to_e4m3(x, inv[None, :])
        tl.store(dst_ptr + cols[None, :] * P + (rows + shift)[:, None], q.to(dst_ptr.dtype.element_ty),
                 mask=m)
    zero = tl.zeros([BLOCK_R, BLOCK_C], tl.float32).to(dst_ptr.dtype.element_ty)
    for r0 in range(end + shift, pend, BLOCK_R):
        rows = r0 + rr
        m = (rows < pend)[:, None] & cmask[None, :]
        tl.store(dst_ptr + cols[None, :] * P + rows[:, None], zero, mask=m)


@triton.jit
def _cols_pair_kernel(a_ptr, b_ptr, qa_ptr, qb_ptr, sa_ptr, sb_ptr, offs_ptr, pads_ptr, A, B, P,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    g = tl.program_id(0)
    cb = tl.program_id(1)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + g).to(tl.int64)
    pstart = tl.load(pads_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    pend = tl.load(pads_ptr + g).to(tl.int64)
    blocks_a = tl.cdiv(A, BLOCK_C)
    if cb < blocks_a:
        _quantize_group_cols(a_ptr, qa_ptr, sa_ptr, A, P, g, cb * BLOCK_C, start, end, pstart, pend,
                             BLOCK_R, BLOCK_C)
    else:
        _quantize_group_cols(b_ptr, qb_ptr, sb_ptr, B, P, g, (cb - blocks_a) * BLOCK_C, start, end, pstart, pend,
                             BLOCK_R, BLOCK_C)


def _empty_outputs(a_RA: torch.Tensor, b_RB: torch.Tensor, e: int, P: int) -> list[torch.Tensor]:
    dev = a_RA.device
    return [torch.empty((a_RA.shape[1], P), dtype=FP8, device=dev), torch.empty((b_RB.shape[1], P), dtype=FP8, device=dev),
            torch.empty((e, a_RA.shape[1]), dtype=torch.float32, device=dev),
            torch.empty((e, b_RB.shape[1]), dtype=torch.float32, device=dev)]


@triton_op("spmdmoe::quantize_cols_pair", mutates_args=())
def quantize_cols_pair_triton(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton launcher: ``(qa_AP, qb_BP, sa_eA, sb_eB, padded_e)``; ``offsets_e`` the int32 group ends."""
    a_RA, b_RB = a_RA.contiguous(), b_RB.contiguous()
    e = offsets_e.shape[0]
    P = padded_rows(a_RA.shape[0], e)
    padded_e = _padded_ends(offsets_e, P)
    qa, qb, sa, sb = _empty_outputs(a_RA, b_RB, e, P)
    A, B = a_RA.shape[1], b_RB.shape[1]
    blocks = triton.cdiv(A, CONFIG["block_c"]) + triton.cdiv(B, CONFIG["block_c"])
    if e == 0:  # no group: every row is padding
        qa.view(torch.uint8).zero_()
        qb.view(torch.uint8).zero_()
    elif blocks > 0:
        wrap_triton(_cols_pair_kernel)[(e, blocks)](
            a_RA, b_RB, qa, qb, sa, sb, offsets_e, padded_e, A, B, P,
            BLOCK_R=CONFIG["block_r"], BLOCK_C=CONFIG["block_c"], num_warps=CONFIG["num_warps"])
    return qa, qb, sa, sb, padded_e


def _cols_reference(x_RC: torch.Tensor, group_R: torch.Tensor, dest_R: torch.Tensor, e: int, P: int):
    """One operand, vectorised (no host read of the offsets): rows with ``group_R == e`` are outside every group."""
    R, C = x_RC.shape
    inside = (group_R < e)[:, None]
    x = torch.where(inside, x_RC.float(), 0.0)
    amax = x.new_zeros((e + 1, C)).scatter_reduce_(0, group_R[:, None].expand(R, C), x.abs(), "amax")[:e]
    q_RC, _ = quantize_reference(x, torch.cat([amax, amax.new_ones(1, C)])[group_R])
    s_eC = dequant_scale(amax)  # one per (group, column)
    out = torch.zeros((P + 1, C), dtype=torch.uint8, device=x_RC.device)
    out.index_copy_(0, dest_R, q_RC.view(torch.uint8))
    return out[:P].t().contiguous().view(FP8), s_eC


def quantize_cols_pair_reference(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature and outputs (pad rows zero, as the kernel writes them)."""
    R, e = a_RA.shape[0], offsets_e.shape[0]
    P = padded_rows(R, e)
    padded_e = _padded_ends(offsets_e, P)
    if e == 0:
        qa, qb, sa, sb = _empty_outputs(a_RA, b_RB, e, P)
        qa.view(torch.uint8).zero_()
        qb.view(torch.uint8).zero_()
        return qa, qb, sa, sb, padded_e
    rows = torch.arange(R, device=a_RA.device)
    group_R = torch.searchsorted(offsets_e.to(torch.int64), rows, right=True)  # e past the last group
    g = group_R.clamp(max=e - 1)
    starts = torch.cat([offsets_e.new_zeros(1), offsets_e[:-1]]).to(torch.int64)
    pstarts = torch.cat([padded_e.new_zeros(1), padded_e[:-1]]).to(torch.int64)
    dest_R = torch.where(group_R < e, pstarts[g] + rows - starts[g], P)
    qa, sa = _cols_reference(a_RA, group_R, dest_R, e, P)
    qb, sb = _cols_reference(b_RB, group_R, dest_R, e, P)
    return qa, qb, sa, sb, padded_e


def quantize_cols_pair(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the reference elsewhere (``spmdmoe.kernels.backend``)."""
    impl = quantize_cols_pair_triton if use_triton("fp8_cols", a_RA) else quantize_cols_pair_reference
    return impl(a_RA, b_RB, offsets_e)
