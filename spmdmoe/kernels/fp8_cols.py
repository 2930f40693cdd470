"""Per-group columnwise FP8 quantization of the two wgrad operands into a 16-row-aligned layout; hot groups split.

Legend: ``R`` rows in the buffer (expert-major, a capacity), ``A`` / ``B`` the columns of the two operands (``C``:
either one's, in the reference), ``e`` groups (local experts), ``P`` padded rows.

The weight gradient of an expert is ``a[g]^T @ b[g]`` over the rows of its group ``g``
(``rows [offsets[g-1], offsets[g])``): ``(grad_out, x)`` of the up-projection, ``(grad_out, h)`` of the down-projection.
``torch._scaled_grouped_mm`` takes it as a 2-D x 2-D GEMM with the token dim contiguous in both operands (``a^T`` of
shape ``(A, P)``, ``b^T`` of shape ``(B, P)``), every group starting at a multiple of 16 tokens and the total a multiple
of 16, with one scale per (group, column) over that group's rows only. This kernel writes exactly that:

* ``qa_AP``, ``qb_BP``: e4m3, transposed; group ``g``'s rows start at
  ``padded[g-1]`` (a multiple of 16) and are followed by zero rows up to
  ``padded[g]``; the last group's padding runs to ``P``, so ``padded[-1] == P``;
* ``sa_eA``, ``sb_eB``: the fp32 dequantization factors (scale rule:
  :mod:`spmdmoe.kernels.fp8_common`; an empty group gets the all-zero scale);
* ``padded_e``: the padded group ends (int32, on the device; no host sync).

``P = round_up(R + 15 e, 16)``, a host int fixed by the buffer's shape, so nothing here depends on the routed counts on
the host. This is the only padding of the FP8 path (forward and dgrad GEMMs take unaligned groups), and it is written
here, by the quantizer: no separate pad or unpad copy. Rows past ``offsets[-1]`` (a capacity buffer's tail) are never
read.

A group of at most ``SPLIT_ABOVE`` times the mean rows is read by one program per block of ``BLOCK_C`` columns: its
column amax, then scale, cast and transposed write walking the rows backwards (the rows read last are re-read first,
from L2 if they are still there). A larger group (a hot expert) would serialise that program, so it takes two passes:

1. the amax pass, a fixed grid of (block of columns, row program): each split group's row tiles dealt
   round-robin to the row programs, their column amax into ``m[g]`` by ``tl.atomic_max`` (order-independent:
   the same result in every run); unsplit groups are not read here;
2. the cast pass, ``SPLITS`` (4) programs per (group, block of columns): each casts its share of the group's rows
   with ``m[g]``; the last share writes the zero pad rows, the first the scales.

Measured (H200, torch 2.11, Triton 3.6, bf16 in; interleaved with the one-program-per-group kernel this
replaced; ``benchmarks/cols_routing.py``; counted bytes = bf16 read once + e4m3 written): 16B's operands
(R = 98,304 rows, A = 2048, B = 1408, e = 64), group sizes drawn from balanced / Zipf-0.5 / Zipf-1 routing and one
hot expert: 0.711 / 0.722 / 0.789 / 1.263 ms, 0.93x / 1.12x / 1.54x / 3.17x the one-program kernel; balanced
1.43 TB/s counted (34 % of 4.2); torchao 0.18's ``triton_fp8_per_group_colwise_scales_dual`` (no 16-row
layout) took 0.793 ms there (an earlier run of the same benchmark). V3's (131,072 rows of 7168 + 2048, e = 32): 2.227 / 2.250 / 2.274 / 2.695 ms, 0.94x / 1.04x / 1.27x /
2.60x. The balanced loss (6-7 %) is not isolated; what differs from the old kernel there is the amax pass's
launch (nothing to read), the zeroed amax buffers and the cast grid's idle parts. Every group's rows are read twice,
which caps the counted bandwidth at 60 % of copy; taking the amax in the kernels that produce the operands instead was
measured not to pay: an atomic max per element in a row-per-program producer adds 12-15 ms per GB read (1.6-2.3 ms per
GB at 8 rows per program) against 0.3 ms per GB for a separate read (``benchmarks/producer_amax.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .backend import by_backend, kernel_op
from .fp8_common import EPS_C, FP8, dequant_scale, e4m3_inverse, e4m3_scale, quantize_reference, to_e4m3

__all__ = ["padded_rows", "quantize_cols_pair", "quantize_cols_pair_reference", "quantize_cols_pair_triton"]

ALIGN = 16
# launch configurations of the two passes (benchmarks/kernels.py sweeps them on the GPU: fp8_cols, fp8_cols_cast)
CONFIG = {"block_r": 128, "block_c": 64, "row_programs": 64, "num_warps": 2}
CAST_CONFIG = {"splits": 4, "block_r": 128, "block_c": 64, "num_warps": 4, "group_major": True}
# a group with more rows than this many times the mean group is split across programs (its amax by pass 1)
SPLIT_ABOVE = 2


def padded_rows(R: int, e: int) -> int:
    """``P``: rows of the aligned layout for ``R`` buffer rows in ``e`` groups (host ints only)."""
    return -(-(R + (ALIGN - 1) * e) // ALIGN) * ALIGN


def _padded_ends(offsets_e: torch.Tensor, P: int) -> torch.Tensor:
    """Group ends rounded up to multiples of 16, the last one ``P``: int32, on the device."""
    sizes = torch.diff(offsets_e, prepend=offsets_e.new_zeros(1))
    ends = torch.cumsum((sizes + (ALIGN - 1)) // ALIGN * ALIGN, 0)
    return torch.cat([ends[:-1], ends.new_full((1,), P)]).to(torch.int32)


@triton.jit
def _split_above(total, e, SPLIT_ABOVE: tl.constexpr):
    """Rows above which a group is split across programs: ``SPLIT_ABOVE`` times the mean of the ``e`` groups
    (``total`` rows, on the device)."""
    return SPLIT_ABOVE * tl.cdiv(total, e)


@triton.jit
def _split_amax(src_ptr, m_ptr, offs_ptr, C, c0, e, big, step, first_tile, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Columns ``[c0, c0 + BLOCK_C)`` of every group with more than ``big`` rows: row tiles ``first_tile``,
    ``first_tile + step``, ... of the group, read once, their column amax into ``m[g]`` (atomic max)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    cmask = cols < C
    rr = tl.arange(0, BLOCK_R)
    for g in range(0, e):
        start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        end = tl.load(offs_ptr + g)
        if end - start > big:
            amax = tl.zeros([BLOCK_C], tl.float32)
            for r0 in range(start + first_tile * BLOCK_R, end, step * BLOCK_R):
                rows = r0 + rr
                x = tl.load(src_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
                            mask=(rows < end)[:, None] & cmask[None, :], other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
            tl.atomic_max(m_ptr + g * C + cols, amax, mask=cmask)


@triton.jit
def _cols_amax_kernel(a_ptr, b_ptr, ma_ptr, mb_ptr, offs_ptr, A, B, e, SPLIT_ABOVE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pass 1, a fixed grid of (block of columns of either operand, row program): the per-(group, column) amax of
    the split groups only, each group's row tiles dealt round-robin to the row programs (a balanced routing
    leaves this pass with nothing to read)."""
    cb = tl.program_id(0)
    big = _split_above(tl.load(offs_ptr + e - 1), e, SPLIT_ABOVE)
    step = tl.num_programs(1)
    blocks_a = tl.cdiv(A, BLOCK_C)
    if cb < blocks_a:
        _split_amax(a_ptr, ma_ptr, offs_ptr, A, cb * BLOCK_C, e, big, step, tl.program_id(1), BLOCK_R, BLOCK_C)
    else:
        _split_amax(b_ptr, mb_ptr, offs_ptr, B, (cb - blocks_a) * BLOCK_C, e, big, step, tl.program_id(1), BLOCK_R,
                    BLOCK_C)


@triton.jit
def _cast_rows(src_ptr, dst_ptr, m_ptr, s_ptr, C, P, g, c0, lo, hi, shift, pad_lo, pad_hi, first, own,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``[lo, hi)`` of group ``g``, columns ``[c0, c0 + BLOCK_C)``: the e4m3 values written transposed at
    ``dst + col * P + row + shift``, then zero rows ``[pad_lo, pad_hi)`` of the layout; ``first``: also the
    group's dequantization scales ``s[g]``. The amax is ``m[g]`` (pass 1) or, with ``own`` (the program holds
    the whole group), read here first; the cast then walks the rows backwards, so that the rows read last are
    re-read first, from L2 if they are still there."""
    cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
    cmask = cols < C
    rr = tl.arange(0, BLOCK_R)
    if own:
        amax = tl.zeros([BLOCK_C], tl.float32)
        for r0 in range(lo, hi, BLOCK_R):
            rows = r0 + rr
            x = tl.load(src_ptr + rows[:, None] * C + cols[None, :], mask=(rows < hi)[:, None] & cmask[None, :],
                        other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    else:
        amax = tl.load(m_ptr + g * C + cols, mask=cmask, other=0.0)
    amax = tl.maximum(amax, EPS_C)
    if first:
        tl.store(s_ptr + g * C + cols, e4m3_scale(amax), mask=cmask)
    inv = e4m3_inverse(amax)
    chunks = tl.cdiv(hi - lo, BLOCK_R)
    for i in range(0, chunks):
        rows = lo + (chunks - 1 - i) * BLOCK_R + rr
        m = (rows < hi)[:, None] & cmask[None, :]
        x = tl.load(src_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(dst_ptr + cols[None, :] * P + (rows + shift)[:, None],
                 to_e4m3(x, inv[None, :]).to(dst_ptr.dtype.element_ty), mask=m)
    zero = tl.zeros([BLOCK_R, BLOCK_C], tl.float32).to(dst_ptr.dtype.element_ty)
    for r0 in range(pad_lo, pad_hi, BLOCK_R):
        rows = r0 + rr
        tl.store(dst_ptr + cols[None, :] * P + rows[:, None], zero, mask=(rows < pad_hi)[:, None] & cmask[None, :])


@triton.jit
def _cols_cast_kernel(a_ptr, b_ptr, qa_ptr, qb_ptr, sa_ptr, sb_ptr, ma_ptr, mb_ptr, offs_ptr, pads_ptr, A, B, P, e,
                      SPLITS: tl.constexpr, SPLIT_ABOVE: tl.constexpr, GROUP_MAJOR: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """Pass 2, one program per (block of columns of either operand, group, part). A split group (more than
    ``SPLIT_ABOVE`` times the mean rows): part ``s`` of ``SPLITS`` of its rows with pass 1's amax, the last part
    writing the zero pad rows. Any other group: part 0 alone, amax, cast and pad rows; the other parts exit."""
    if GROUP_MAJOR:  # the groups vary fastest
        g = tl.program_id(0)
        cb = tl.program_id(1)
    else:
        cb = tl.program_id(0)
        g = tl.program_id(1)
    part = tl.program_id(2)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + g).to(tl.int64)
    pstart = tl.load(pads_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    pend = tl.load(pads_ptr + g).to(tl.int64)
    split = end - start > _split_above(tl.load(offs_ptr + e - 1), e, SPLIT_ABOVE)
    parts = tl.where(split, SPLITS, 1)
    if part < parts:
        share = tl.cdiv(tl.cdiv(end - start, parts), BLOCK_R) * BLOCK_R
        lo = tl.minimum(start + part * share, end)
        hi = tl.minimum(lo + share, end)
        shift = pstart - start
        pad_lo = tl.where(part == parts - 1, end + shift, pend)
        own = (split == 0).to(tl.int32)
        blocks_a = tl.cdiv(A, BLOCK_C)
        if cb < blocks_a:
            _cast_rows(a_ptr, qa_ptr, ma_ptr, sa_ptr, A, P, g, cb * BLOCK_C, lo, hi, shift, pad_lo, pend, part == 0,
                       own, BLOCK_R, BLOCK_C)
        else:
            _cast_rows(b_ptr, qb_ptr, mb_ptr, sb_ptr, B, P, g, (cb - blocks_a) * BLOCK_C, lo, hi, shift, pad_lo,
                       pend, part == 0, own, BLOCK_R, BLOCK_C)


def _blocks(A: int, B: int, block_c: int) -> int:
    """Column blocks of both operands: the fastest-varying part of either pass's program index."""
    return triton.cdiv(A, block_c) + triton.cdiv(B, block_c)


def _empty_outputs(a_RA: torch.Tensor, b_RB: torch.Tensor, e: int, P: int) -> list[torch.Tensor]:
    dev = a_RA.device
    return [torch.empty((a_RA.shape[1], P), dtype=FP8, device=dev), torch.empty((b_RB.shape[1], P), dtype=FP8, device=dev),
            torch.empty((e, a_RA.shape[1]), dtype=torch.float32, device=dev),
            torch.empty((e, b_RB.shape[1]), dtype=torch.float32, device=dev)]


@kernel_op("spmdmoe::quantize_cols_pair", mutates_args=())
def quantize_cols_pair_triton(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton launcher: ``(qa_AP, qb_BP, sa_eA, sb_eB, padded_e)``; ``offsets_e`` the int32 group ends."""
    a_RA, b_RB = a_RA.contiguous(), b_RB.contiguous()
    e = offsets_e.shape[0]
    P = padded_rows(a_RA.shape[0], e)
    padded_e = _padded_ends(offsets_e, P)
    qa, qb, sa, sb = _empty_outputs(a_RA, b_RB, e, P)
    A, B = a_RA.shape[1], b_RB.shape[1]
    if e == 0:  # no group: every row is padding
        qa.view(torch.uint8).zero_()
        qb.view(torch.uint8).zero_()
    elif A + B > 0:
        # the per-(group, column) amax (atomic max). Two allocations: with both as views of one buffer a compiled
        # DeepSeek-V3 step faulted in an inductor kernel (H200, torch 2.11); with two it runs
        ma = torch.zeros((e, A), dtype=torch.float32, device=a_RA.device)
        mb = torch.zeros((e, B), dtype=torch.float32, device=a_RA.device)
        c = CONFIG
        wrap_triton(_cols_amax_kernel)[(_blocks(A, B, c["block_c"]), c["row_programs"])](
            a_RA, b_RB, ma, mb, offsets_e, A, B, e, SPLIT_ABOVE=SPLIT_ABOVE, BLOCK_R=c["block_r"],
            BLOCK_C=c["block_c"], num_warps=c["num_warps"])
        c = CAST_CONFIG
        grid = (e, _blocks(A, B, c["block_c"])) if c["group_major"] else (_blocks(A, B, c["block_c"]), e)
        wrap_triton(_cols_cast_kernel)[grid + (c["splits"],)](
            a_RA, b_RB, qa, qb, sa, sb, ma, mb, offsets_e, padded_e, A, B, P, e, SPLITS=c["splits"],
            SPLIT_ABOVE=SPLIT_ABOVE, GROUP_MAJOR=c["group_major"], BLOCK_R=c["block_r"], BLOCK_C=c["block_c"],
            num_warps=c["num_warps"])
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


quantize_cols_pair = by_backend("fp8_cols", quantize_cols_pair_triton, quantize_cols_pair_reference)
