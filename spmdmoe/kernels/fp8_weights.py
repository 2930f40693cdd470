"""Both FP8 layouts of a 3-D weight from two reads: rowwise (the forward GEMM's) and its transpose (dgrad's).

Legend: ``e`` experts (groups), ``A`` rows and ``C`` columns of each expert's matrix.

An expert weight ``w[g]`` (``A x C``) feeds two FP8 GEMMs (:mod:`spmdmoe.moe.experts.fp8`): the forward, contracting
``C``, takes it quantized per row (``q_eAC``, ``s_eA``); the input gradient, contracting ``A``, takes its
transpose quantized per row of the transpose, i.e. per column of ``w[g]`` (``q_eCA``, ``s_eC``), written
transposed so that ``A`` is contiguous. Each scale is a max over a whole row or a whole column, so one read
cannot produce both; this takes two, in two launches:

1. one program per ``BLOCK_R`` rows of one expert reads its rows, writes their rowwise e4m3 and scales, and
   stores the column amax over its ``BLOCK_R`` rows (``partial_eBC``, fp32, ``B = cdiv(A, BLOCK_R)``);
2. one program per (expert, ``BLOCK_C`` columns, ``ROWS`` rows) reduces those partials to the column amax,
   reads its rows again and writes them quantized and transposed.

Max is exact in any order, so both outputs equal the rowwise quantizer's (:mod:`spmdmoe.kernels.fp8_rows`)
of ``w`` and of ``w.transpose(1, 2)`` bit for bit (tested; :func:`quantize_weight_pair_reference`). The
scale rule and the rounding: :mod:`spmdmoe.kernels.fp8_common`. The ``_into`` form writes into given tensors
where a one-element device ``gate`` is nonzero and touches nothing otherwise (the weight cache's gated
refresh, :mod:`spmdmoe.moe.experts.fp8_cache`; both launches read the gate, so a closed gate costs two empty launches).

Before this module the two layouts took the rowwise quantizer plus a column kernel reading each expert's
columns twice, the second read mostly from HBM: three reads of the weights against two here.

Measured (H200, torch 2.11, Triton 3.6; both weights of a layer, interleaved with the code before):
DeepSeek-MoE-16B's 1.11 GB of bf16 expert weights in 1.308 ms against 1.657 (1.27x), Qwen3-30B's 1.21 GB
1.480 / 1.752 (1.18x), Qwen3-235B's 4.83 GB 5.418 / 6.880 (1.27x), DeepSeek-V3's shard 2.82 GB 3.458 / 4.169
(1.21x): 1.6-1.8 TB/s counting two reads and the two e4m3 writes (40 % of copy). The columns pass alone runs
near copy speed (2.6-3.2 TB/s: 16B's ``[w1 | w3]`` in 0.376 ms, a clone of it 0.354); the rows pass is what
is left above it (0.41 ms for the same weight, 0.37 for the plain rowwise quantizer, which writes no partials).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .backend import by_backend, kernel_op, use_triton
from .fp8_common import EPS_C, FP8, e4m3_inverse, e4m3_scale, to_e4m3, write_where
from .fp8_rows import quantize_rows_reference

Pair = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (q_eAC, s_eA, q_eCA, s_eC)

__all__ = ["quantize_weight_pair", "quantize_weight_pair_into", "quantize_weight_pair_reference",
           "quantize_weight_pair_triton"]

# launch configurations. The rows pass, by the row's width rounded up to a power of two (narrower rows take
# the first entry, wider ones the tiled path): (block_r, sub_r, num_warps), swept per width on the H200
# (benchmarks/sweep_weight_rows.py; some configurations run 4x slower at one width only, so one config for
# all widths does not do); the tiled path's (block_r, block_c, num_warps). The columns pass: one config
# (benchmarks/kernels.py --sweep-only fp8_weights_cols).
ROWS_CONFIG = {1024: (32, 1, 8), 2048: (16, 2, 4), 4096: (16, 2, 8), 8192: (16, 2, 16)}
TILED_CONFIG = (32, 256, 4)
COLS_CONFIG = {"block_r": 128, "block_c": 128, "rows": 4096, "num_warps": 4}


def _rows_launch(C: int) -> tuple[int, int, int, int, bool]:
    """``(block_r, sub_r, block_c, num_warps, one_tile)`` of the rows pass for rows of ``C`` columns."""
    width = max(triton.next_power_of_2(C), min(ROWS_CONFIG))
    if width in ROWS_CONFIG:
        block_r, sub_r, num_warps = ROWS_CONFIG[width]
        return block_r, sub_r, width, num_warps, True
    block_r, block_c, num_warps = TILED_CONFIG
    return block_r, block_r, block_c, num_warps, False


@triton.jit
def _rows_pass(w_ptr, q_ptr, s_ptr, part_ptr, gate_ptr, A, C, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr,
               SUB_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_TILE: tl.constexpr):
    """Rows ``[rb * BLOCK_R, ...)`` of expert ``g``: rowwise e4m3 + scales, and their column amax into
    ``part[g, rb, :]``. A row up to ``BLOCK_C`` columns: ``SUB_R`` rows at a time, each read once, the column
    amax kept in registers; wider rows: ``BLOCK_R x BLOCK_C`` tiles, read twice (the second time from L2)."""
    rb = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    go = tl.full([], 1, tl.int32)
    if HAS_GATE:
        go = (tl.load(gate_ptr) != 0).to(tl.int32)
    if go != 0:
        part = part_ptr + (g * tl.cdiv(A, BLOCK_R) + rb) * C
        cols = tl.arange(0, BLOCK_C)
        if ONE_TILE:
            cmask = cols < C
            col_amax = tl.zeros([BLOCK_C], tl.float32)
            for r0 in tl.static_range(0, BLOCK_R, SUB_R):
                rows = rb * BLOCK_R + r0 + tl.arange(0, SUB_R)
                live = rows < A
                base = (g * A + rows)[:, None].to(tl.int64) * C
                m = live[:, None] & cmask[None, :]
                x = tl.load(w_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                col_amax = tl.maximum(col_amax, tl.max(tl.abs(x), axis=0))
                amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPS_C)
                q = to_e4m3(x, e4m3_inverse(amax)[:, None])
                tl.store(q_ptr + base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
                tl.store(s_ptr + g * A + rows, e4m3_scale(amax), mask=live)
            tl.store(part + cols, col_amax, mask=cmask)
        else:
            rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
            live = rows < A
            base = (g * A + rows)[:, None].to(tl.int64) * C
            amax = tl.full([BLOCK_R], EPS_C, tl.float32)
            for c0 in range(0, C, BLOCK_C):
                m = live[:, None] & (c0 + cols < C)[None, :]
                x = tl.abs(tl.load(w_ptr + base + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32))
                tl.store(part + c0 + cols, tl.max(x, axis=0), mask=c0 + cols < C)
                amax = tl.maximum(amax, tl.max(x, axis=1))
            inv = e4m3_inverse(amax)
            for c0 in range(0, C, BLOCK_C):  # the rows again, from L2
                m = live[:, None] & (c0 + cols < C)[None, :]
                x = tl.load(w_ptr + base + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
                q = to_e4m3(x, inv[:, None])
                tl.store(q_ptr + base + c0 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
            tl.store(s_ptr + g * A + rows, e4m3_scale(amax), mask=live)


@triton.jit
def _cols_pass(w_ptr, q_ptr, s_ptr, part_ptr, gate_ptr, A, C, PARTS, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    """Columns ``[cb * BLOCK_C, ...)`` of expert ``g``, rows ``[rs * ROWS, ...)``: the column amax from the
    ``PARTS`` partials, then ``q[g, col, row] = e4m3(w[g, row, col])`` (and the scales, by ``rs == 0``)."""
    cb = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    rs = tl.program_id(2)
    go = tl.full([], 1, tl.int32)
    if HAS_GATE:
        go = (tl.load(gate_ptr) != 0).to(tl.int32)
    if go != 0:
        cols = (cb * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
        cmask = cols < C
        amax = tl.full([BLOCK_C], EPS_C, tl.float32)
        for p in range(0, PARTS):
            amax = tl.maximum(amax, tl.load(part_ptr + (g * PARTS + p) * C + cols, mask=cmask, other=0.0))
        if rs == 0:
            tl.store(s_ptr + g * C + cols, e4m3_scale(amax), mask=cmask)
        inv = e4m3_inverse(amax)
        rr = tl.arange(0, BLOCK_R)
        r_end = tl.minimum(rs * ROWS + ROWS, A)
        for r0 in range(rs * ROWS, r_end, BLOCK_R):
            rows = (r0 + rr).to(tl.int64)
            m = (rows < r_end)[:, None] & cmask[None, :]
            x = tl.load(w_ptr + (g * A + rows)[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
            q = to_e4m3(x, inv[None, :])
            tl.store(q_ptr + g * C * A + cols[None, :] * A + rows[:, None], q.to(q_ptr.dtype.element_ty), mask=m)


def _launch(rows_kernel: Any, cols_kernel: Any, w_eAC: torch.Tensor, q_eAC: torch.Tensor, s_eA: torch.Tensor,
            q_eCA: torch.Tensor, s_eC: torch.Tensor, gate: Optional[torch.Tensor]) -> None:
    """The two passes over a contiguous ``w_eAC`` (the kernels themselves, or ``wrap_triton`` of them)."""
    e, A, C = w_eAC.shape
    if not (e and A and C):
        return
    block_r, sub_r, block_c, num_warps, one_tile = _rows_launch(C)
    assert block_r % sub_r == 0, f"fp8_weights.ROWS_CONFIG: sub_r must divide block_r, found {sub_r} and {block_r}"
    parts = triton.cdiv(A, block_r)
    partial_eBC = torch.empty((e, parts, C), dtype=torch.float32, device=w_eAC.device)
    g = gate if gate is not None else s_eA
    rows_kernel[(parts, e)](w_eAC, q_eAC, s_eA, partial_eBC, g, A, C, HAS_GATE=gate is not None, BLOCK_R=block_r,
                            SUB_R=sub_r, BLOCK_C=block_c, ONE_TILE=one_tile, num_warps=num_warps)
    cc = COLS_CONFIG
    cols_kernel[(triton.cdiv(C, cc["block_c"]), e, triton.cdiv(A, cc["rows"]))](
        w_eAC, q_eCA, s_eC, partial_eBC, g, A, C, parts, HAS_GATE=gate is not None, BLOCK_R=cc["block_r"],
        BLOCK_C=cc["block_c"], ROWS=cc["rows"], num_warps=cc["num_warps"])


def _empty_pair(w_eAC: torch.Tensor) -> Pair:
    e, A, C = w_eAC.shape
    f32, dev = torch.float32, w_eAC.device
    return (torch.empty((e, A, C), dtype=FP8, device=dev), torch.empty((e, A), dtype=f32, device=dev),
            torch.empty((e, C, A), dtype=FP8, device=dev), torch.empty((e, C), dtype=f32, device=dev))


@kernel_op("spmdmoe::quantize_weight_pair", mutates_args=())
def quantize_weight_pair_triton(w_eAC: torch.Tensor) -> Pair:
    """The Triton launcher. ``w_eAC``: ``(e, A, C)`` bf16 / fp16 / fp32 weights. Returns ``(q_eAC, s_eA, q_eCA,
    s_eC)``: e4m3 rows of each ``w[g]`` and their fp32 dequantization scales, then e4m3 rows of each
    ``w[g]^T`` (``(e, C, A)``, no transposing copy made) and theirs."""
    w_eAC = w_eAC.contiguous()
    out = _empty_pair(w_eAC)
    _launch(wrap_triton(_rows_pass), wrap_triton(_cols_pass), w_eAC, *out, None)
    return out


def quantize_weight_pair_reference(w_eAC: torch.Tensor) -> Pair:
    """Plain torch, same signature: the rowwise reference of ``w`` and of the transposing copy of ``w``."""
    e, A, C = w_eAC.shape
    q, s = quantize_rows_reference(w_eAC.reshape(e * A, C))
    q_t, s_t = quantize_rows_reference(w_eAC.transpose(1, 2).reshape(e * C, A))
    return q.view(e, A, C), s.view(e, A), q_t.view(e, C, A), s_t.view(e, C)


quantize_weight_pair = by_backend("fp8_weights", quantize_weight_pair_triton, quantize_weight_pair_reference)


def quantize_weight_pair_into(w_eAC: torch.Tensor, q_eAC: torch.Tensor, s_eA: torch.Tensor, q_eCA: torch.Tensor,
                              s_eC: torch.Tensor, gate: torch.Tensor) -> None:
    """``q_eAC, s_eA, q_eCA, s_eC = quantize_weight_pair(w_eAC)`` in place where the one-element int device
    tensor ``gate`` is nonzero; a zero gate leaves all four untouched (module docstring)."""
    if use_triton("fp8_weights", w_eAC):
        _launch(_rows_pass, _cols_pass, w_eAC.contiguous(), q_eAC, s_eA, q_eCA, s_eC, gate)
    else:
        write_where(gate, (q_eAC, s_eA, q_eCA, s_eC), quantize_weight_pair_reference(w_eAC))
