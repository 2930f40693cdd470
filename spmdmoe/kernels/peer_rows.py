"""Row moves between the ranks of one host through a symmetric buffer: each rank reads its peers' memory.

Legend: ``n`` ranks, ``T`` rows of a source (at most ``Tm``, the static ``T_max``), ``Q = n * Tm`` rows of
a receive layout (source ``s``'s row ``t`` at ``s * Tm + t``), ``D`` row width.

Every rank of a group holds one buffer of the same size; :class:`PeerRows` is that buffer as this rank sees it
(each rank's mapped into its address space: CUDA symmetric memory, ``spmdmoe.moe.transports.symmetric``). Two moves:

* :func:`pull_rows`: ``out[s * Tm + t] = rank s's row t`` where ``mask_Q`` says so, zero elsewhere: a
  receiver gathering the rows its peers staged (each at most once: the EP dispatch sends a token once per rank);
* :func:`pull_sum`: ``out[t] = sum over d with need[t, d] of rank d's row (me * Tm + t)``, fp32, ranks in order,
  rounded once: a sender summing what each rank it visited staged for it (the EP combine), bit for bit the
  order of :mod:`spmdmoe.kernels.gather_sum` (``0 + row_0 + row_1 ...``).

The caller orders the accesses (a barrier after the peers staged, another before anyone stages again); the
kernels only read peers' memory and write this rank's ``out``. Each is the other's backward.

Measured (``benchmarks/sync_free.py``'s row moves, ``benchmarks/ARCHIVE.md``, issue 42, the 19:41 UTC run of
2026-11-27, H100, 16k tokens a rank of 2048 bf16): the EP dispatch (stage, every rank's ids, the rows, two barriers;
graphed) moves the rows that cross at 179 GB/s at EP 2 (66 MB a direction; the copy engines' ``copy_`` from the
peer: 360 GB/s) and 232 GB/s at EP 4 (168 MB; an even NCCL all-to-all of the same rows: 288 GB/s; the copy engines
from one peer: 368 GB/s). At EP 4 each rank reading its sources from its next peer on is what makes 232: in
program order (every rank reading rank 0's buffer first, three readers on one rank's links) the same op moved
140 GB/s (the 16:10 UTC run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["PeerRows", "pull_rows", "pull_rows_reference", "pull_rows_triton", "pull_sum", "pull_sum_reference",
           "pull_sum_triton"]


@dataclass(frozen=True)
class PeerRows:
    """One buffer of every rank of a group, as this rank sees it.

    Attributes:
        views: rank ``r``'s buffer (flat, one dtype, the same numel on every rank), ``r`` in group order.
        ptrs: int64 ``(n,)`` on the buffers' device: ``views[r].data_ptr()`` (read by the kernels).
        rank: this rank's index in the group.
    """

    views: tuple[torch.Tensor, ...]
    ptrs: torch.Tensor
    rank: int


@triton.jit
def _pull_rows_kernel(ptrs, mask_ptr, out_ptr, offset, Tm, D, first, n, BLOCK_D: tl.constexpr):
    """Program (j * Tm + t, block of D): with ``s = (first + j) % n``, ``out[s * Tm + t] = rank s's row t`` if
    ``mask[s * Tm + t]``, else 0. The programs run about in order, so a rank reads its sources in turn from
    ``first`` (each rank another: no rank's buffer read by every peer at once). ``ptrs``: int64 base addresses of
    the ranks' buffers; ``offset``: the region's first element in them."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = pid // Tm
    s = (first + j) % n
    q = s * Tm + (pid - j * Tm)
    base = tl.load(ptrs + s).to(tl.pointer_type(out_ptr.dtype.element_ty))
    keep = tl.load(mask_ptr + q) != 0
    m = offs < D
    v = tl.load(base + offset + (pid - j * Tm) * D + offs, mask=m & (offs * 0 + keep.to(tl.int32) > 0), other=0.0)
    tl.store(out_ptr + q * D + offs, v, mask=m)


@triton.jit
def _pull_sum_kernel(ptrs, need_ptr, out_ptr, offset, me, Tm, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (t, block of D): ``out[t] = sum over d < N with need[t, d] of rank d's row (me * Tm + t)``, fp32 in
    rank order, rounded once. ``ptrs``, ``offset``: as :func:`_pull_rows_kernel`'s."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d in tl.static_range(N):
        base = tl.load(ptrs + d).to(tl.pointer_type(out_ptr.dtype.element_ty))
        keep = tl.load(need_ptr + t * N + d) != 0
        acc += tl.load(base + offset + (me * Tm + t) * D + offs, mask=m & (offs * 0 + keep.to(tl.int32) > 0),
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


CONFIG = {"block_d": 2048, "num_warps": 8}


def _grid(rows: int, D: int) -> tuple[tuple[int, int], int]:
    block = max(16, min(triton.next_power_of_2(max(D, 1)), CONFIG["block_d"]))
    return (rows, triton.cdiv(D, block)), block


def pull_rows_triton(peers: PeerRows, mask_Q: torch.Tensor, t_max: int, D: int, offset: int = 0) -> torch.Tensor:
    """``(Q, D)`` in the buffers' dtype: row ``s * t_max + t`` is rank ``s``'s row ``t`` (its buffer read from
    element ``offset`` as ``(t_max, D)`` rows) where ``mask_Q`` (bool ``(Q,)``) is set, zero elsewhere."""
    Q = mask_Q.shape[0]
    if Q != len(peers.views) * t_max:
        raise ValueError(f"pull_rows: mask_Q has {Q} rows, expected n * t_max = {len(peers.views)} * {t_max}")
    out = torch.empty((Q, D), dtype=peers.views[0].dtype, device=mask_Q.device)
    if Q > 0 and D > 0:
        grid, block = _grid(Q, D)
        n = len(peers.views)  # each rank starts at its next peer (the kernel's docstring)
        _pull_rows_kernel[grid](peers.ptrs, mask_Q, out, offset, t_max, D, (peers.rank + 1) % n, n, BLOCK_D=block,
                                num_warps=CONFIG["num_warps"])
    return out


def pull_rows_reference(peers: PeerRows, mask_Q: torch.Tensor, t_max: int, D: int, offset: int = 0) -> torch.Tensor:
    """Plain torch, :func:`pull_rows_triton`'s signature and result (the peers' views read directly)."""
    rows = torch.cat([v[offset: offset + t_max * D].view(t_max, D) for v in peers.views])
    return torch.where(mask_Q.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def pull_sum_triton(peers: PeerRows, need_Tn: torch.Tensor, t_max: int, D: int, offset: int = 0) -> torch.Tensor:
    """``(T, D)`` in the buffers' dtype: row ``t`` is the fp32 sum, over the ranks ``d`` that ``need_Tn``
    (bool ``(T, n)``) marks, in rank order, of rank ``d``'s row ``me * t_max + t`` (its buffer read from
    element ``offset`` as ``(n * t_max, D)`` rows), rounded once."""
    T, n = need_Tn.shape
    out = torch.empty((T, D), dtype=peers.views[0].dtype, device=need_Tn.device)
    if T > 0 and D > 0:
        grid, block = _grid(T, D)
        _pull_sum_kernel[grid](peers.ptrs, need_Tn.contiguous(), out, offset, peers.rank, t_max, D, N=n, BLOCK_D=block,
                               num_warps=CONFIG["num_warps"])
    return out


def pull_sum_reference(peers: PeerRows, need_Tn: torch.Tensor, t_max: int, D: int, offset: int = 0) -> torch.Tensor:
    """Plain torch, :func:`pull_sum_triton`'s signature and result."""
    T, n = need_Tn.shape
    acc_dtype = torch.promote_types(peers.views[0].dtype, torch.float32)
    acc = torch.zeros((T, D), dtype=acc_dtype, device=need_Tn.device)
    start = offset + peers.rank * t_max * D
    for d, v in enumerate(peers.views):
        rows = v[start: start + T * D].view(T, D).to(acc_dtype)
        acc = acc + torch.where(need_Tn[:, d: d + 1], rows, torch.zeros((), dtype=acc_dtype, device=acc.device))
    return acc.to(peers.views[0].dtype)


def _triton(peers: PeerRows) -> bool:
    return peers.views[0].is_cuda and peers.views[0].dtype in (torch.bfloat16, torch.float16, torch.float32)


def pull_rows(peers: PeerRows, mask_Q: torch.Tensor, t_max: int, D: int, offset: int = 0) -> torch.Tensor:
    """The Triton kernel on CUDA (bf16 / fp16 / fp32), the reference elsewhere."""
    return (pull_rows_triton if _triton(peers) else pull_rows_reference)(peers, mask_Q, t_max, D, offset)


def pull_sum(peers: PeerRows, need_Tn: torch.Tensor, t_max: int, D: int, offset: int = 0) -> torch.Tensor:
    """The Triton kernel on CUDA (bf16 / fp16 / fp32), the reference elsewhere."""
    return (pull_sum_triton if _triton(peers) else pull_sum_reference)(peers, need_Tn, t_max, D, offset)
