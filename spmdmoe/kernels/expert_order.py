"""Expert order of routed copies: each copy's row in a stable expert-major buffer, the groups' ends, the counts.

Legend: ``M`` source rows, ``J`` copies per source row (a row's expert ids), ``e`` local experts (ids
``first .. first + e - 1``), ``E`` the ids counted (``total``), ``R`` the buffer's rows, ``C`` copies a chunk.

Copy ``(s, j)`` of a local id goes to row ``pos[s, j]``, grouped by expert, within one by ``s * J + j`` (a stable
sort); ``-1`` for any other id (another rank's expert; ``-1``) and past ``R`` rows (a capacity's overflow, dropped).
``offsets``: the int32 group ends, clamped at ``R`` (``grouped_mm``'s ``offs``); ``totals``: the copies of every id
``< E`` (every rank's demand, where the ids are every rank's). Ids: any dtype holding exact integers (the fp32 ids
beside the routing weights too), any row stride (a column slice: nothing copied).

Three launches, no host sync, integers only (exact, deterministic): each chunk's counts (``tl.histogram``); a
program per 2 experts scans their columns down the chunks (each chunk's copies of an expert before it, written over
its counts) and sums their totals; each chunk's rows (the group's first row, from the totals, plus the copies of the
expert in the chunks before, plus those before in the chunk; program 0 writes the group ends). They replace about
twenty small torch ops, each a launch and host time in an eager step (issue 61).

Measured (H200, torch 2.11, Triton 3.6, E=64, K=6, T=16,384; device time a launch, counts / scan / positions):
N int64 ids, every expert here, 2 / 3 / 13 us; EP 2's received 2N fp32 ids, 32 here, 2 / 5 / 23 us; EP 4's 4N,
3 / 9 / 43 us (the scan in one program took 99 us at EP 2; the group's first row as a masked (C, B) sum in place of
``tl.gather`` made positions 0.52 ms). Eagerly a call is host-bound, 90-140 us (``benchmarks/kernels.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import wrap_triton

from .backend import kernel_op, unit_rows, use_triton

__all__ = ["expert_order", "expert_order_reference", "expert_order_triton"]

CHUNK = 128  # copies a program orders (its rank-within-chunk compares C x C)
SCAN_BINS, SCAN_CHUNKS = 2, 1024  # the scan: bins a program, chunks a step (H200: fastest of 8 tried)


@triton.jit
def _chunk(p, MJ, J, C: tl.constexpr):
    """Chunk ``p``'s copies: rank in it, flat index, existence, row, column (no pointer: test_kernel_writes.py)."""
    r = tl.arange(0, C)
    i = p * C + r
    m = i // J
    return r, i, i < MJ, m.to(tl.int64), i - m * J


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, MJ, J, stride_m, total, C: tl.constexpr, B: tl.constexpr):
    _, _, live, m, j = _chunk(tl.program_id(0), MJ, J, C)
    key = tl.load(ids_ptr + m * stride_m + j, mask=live, other=-1).to(tl.int32)
    key = tl.where(live & (key >= 0) & (key < total), key, total)  # not counted: the last bin
    tl.store(counts_ptr + tl.program_id(0).to(tl.int64) * B + tl.arange(0, B), tl.histogram(key, B))


@triton.jit
def _chunk_scan_kernel(counts_ptr, totals_ptr, P, total, B: tl.constexpr, BB: tl.constexpr, BP: tl.constexpr):
    """Program (``BB`` bins): each bin's copies in every chunk before, written over the chunks' counts (a scan down
    the bin's column, ``BP`` chunks a step), and the bin's total (bins below ``total``)."""
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    run = tl.zeros([BB], dtype=tl.int64)
    for p0 in range(0, P, BP):
        ps = p0 + tl.arange(0, BP)
        at = counts_ptr + ps[:, None].to(tl.int64) * B + b[None, :]
        c = tl.load(at, mask=(ps < P)[:, None], other=0)
        tl.store(at, (run[None, :] + tl.cumsum(c, axis=0) - c).to(tl.int32), mask=(ps < P)[:, None])
        run += tl.sum(c.to(tl.int64), axis=0)
    tl.store(totals_ptr + b, run, mask=b < total)


@triton.jit
def _chunk_positions_kernel(ids_ptr, starts_ptr, totals_ptr, offsets_ptr, pos_ptr, MJ, J, stride_m, first, experts,
                            rows, C: tl.constexpr, B: tl.constexpr):
    p = tl.program_id(0)
    bins = tl.arange(0, B)
    local = (bins >= first) & (bins < first + experts)
    mine = tl.load(totals_ptr + bins, mask=local, other=0)  # the local experts' copies; program 0: their ends
    if p == 0:
        tl.store(offsets_ptr + bins - first, tl.minimum(tl.cumsum(mine, axis=0), rows).to(tl.int32), mask=local)
    r, i, live, m, j = _chunk(p, MJ, J, C)
    key = tl.load(ids_ptr + m * stride_m + j, mask=live, other=-1).to(tl.int32)
    here = live & (key >= first) & (key < first + experts)
    before = tl.sum(((key[:, None] == key[None, :]) & (r[None, :] < r[:, None])).to(tl.int32), axis=1)
    group = tl.gather(tl.cumsum(mine, axis=0) - mine, tl.where(here, key, 0), 0)  # the group's first row
    start = tl.load(starts_ptr + p.to(tl.int64) * B + tl.where(here, key, 0), mask=here, other=0)
    pos = group + start + before
    tl.store(pos_ptr + i, tl.where(here & (pos < rows), pos, -1).to(tl.int64), mask=live)


@kernel_op("spmdmoe::expert_order", mutates_args=())
def expert_order_triton(ids_MJ: torch.Tensor, first: int, experts: int, rows: int, total: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton launcher (see the module docstring)."""
    M, J = ids_MJ.shape
    ids_MJ = unit_rows(ids_MJ)
    device = ids_MJ.device
    B = triton.next_power_of_2(total + 1)
    P = triton.cdiv(M * J, CHUNK)
    pos_MJ = torch.empty((M, J), dtype=torch.int64, device=device)
    offsets = torch.empty((experts,), dtype=torch.int32, device=device)
    totals = torch.empty((total,), dtype=torch.int64, device=device)
    counts = torch.empty((P, B), dtype=torch.int32, device=device)
    stride = ids_MJ.stride(0)
    if guard_or_true(M > 0):
        wrap_triton(_chunk_counts_kernel)[(P,)](ids_MJ, counts, M * J, J, stride, total, C=CHUNK, B=B, num_warps=4)
    BB, BP = min(B, SCAN_BINS), SCAN_CHUNKS if ids_MJ.is_cuda else 4  # the CPU's interpreter: its scan loop turns
    wrap_triton(_chunk_scan_kernel)[(B // BB,)](counts, totals, P, total, B=B, BB=BB, BP=BP, num_warps=4)
    wrap_triton(_chunk_positions_kernel)[(torch.sym_max(P, 1),)](  # program 0 writes the offsets, chunks or none
        ids_MJ, counts, totals, offsets, pos_MJ, M * J, J, stride, first, experts, rows, C=CHUNK, B=B, num_warps=4)
    return pos_MJ, offsets, totals


def expert_order_reference(ids_MJ: torch.Tensor, first: int, experts: int, rows: int, total: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature and results as :func:`expert_order_triton`: a stable argsort of the local
    ids (the others in a last bucket) and its inverse permutation; counts by a fixed-size scatter-add
    (``torch.bincount`` syncs on CUDA to size its output)."""
    ids = ids_MJ.to(torch.int64)
    here = (ids >= first) & (ids < first + experts)
    key_N = torch.where(here, ids - first, experts).reshape(-1)
    order_N = torch.argsort(key_N, stable=True)
    pos_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=ids.device))
    pos_MJ = torch.where(here & (pos_N.view(ids.shape) < rows), pos_N.view(ids.shape), -1)
    ones = torch.ones_like(key_N)
    ends = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key_N, ones)[:experts]
    counted_N = torch.where((ids >= 0) & (ids < total), ids, total).reshape(-1)
    totals = torch.zeros(total + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, counted_N, ones)[:total]
    return pos_MJ, ends.cumsum(0).clamp(max=rows).to(torch.int32), totals


def expert_order(ids_MJ: torch.Tensor, first: int, experts: int, rows: int, total: Optional[int] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pos_MJ, offsets, totals)`` (the module docstring): ``ids_MJ`` ``(M, J)`` expert ids (int, or fp32 /
    fp64 holding integers; ``-1`` or any id outside ``[first, first + experts)``: no copy here), ``first`` the
    first local expert's id, ``experts`` (``e``) the local experts, ``rows`` (``R``) the buffer's rows,
    ``total`` (``E``, at least ``first + experts``; default that) the ids counted. Returns int64 ``(M, J)``,
    int32 ``(e,)``, int64 ``(E,)``. The Triton kernels on CUDA, the reference elsewhere."""
    total = first + experts if total is None else total
    impl = expert_order_triton if use_triton("expert_order", ids_MJ) else expert_order_reference
    return impl(ids_MJ, first, experts, rows, total)
