"""Gather-sum of rows: ``out[s] = sum_j w[s, j] * src[index[s, j]]``, accumulated in fp32.

Legend: ``M`` output rows, ``J`` rows summed into each, ``R`` source rows,
``D`` row width.

One program per (output row, block of ``D``): it reads its ``J`` source rows,
sums them in fp32 in the order ``j = 0 .. J-1`` and rounds once to ``src``'s
dtype (fp64 rows take the reference, in fp64). No atomics, deterministic. An index ``-1`` adds nothing (a
skipped copy: DeepEP's convention), whatever its weight. Rows of ``src`` no index names are never read
(a capacity-sized ``src`` may hold anything there, NaN included).

Uses: the sum of each token's copies (``out[t] = sum_k y[pos[t, k]]``, the
routing weights folded into the experts; the reverse permutation fused in), the
EP combine's sum of a token's rows over the ranks it visited (``-1`` where it
visited none), the weighted combine of a caller's own ``RoutedTokens``, and the
fan-outs' backward (the gradient of a row is the sum over its copies). Its
backward is :mod:`spmdmoe.kernels.fan_out`.

Measured (H200, torch 2.11, Triton 3.6, bf16, T=16,384, K=6, D=2048; ``benchmarks/kernels.py``):
the combine 0.131 ms, 3.59 TB/s (85 % of the 4.2 TB/s copy ceiling); the permute backward
0.128 ms, 3.67 TB/s (87 %).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import wrap_triton

from .backend import by_backend, kernel_op, unit_rows

__all__ = ["gather_sum", "gather_sum_reference", "gather_sum_triton"]


@triton.jit
def _gather_sum_kernel(
    src_ptr, index_ptr, w_ptr, out_ptr, D, stride_src, stride_out,
    J: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(J):
        r = tl.load(index_ptr + s * J + j).to(tl.int64)
        # -1: adds nothing (the mask & r >= 0 as a vector: Triton's interpreter refuses a scalar & vector mask)
        v = tl.load(src_ptr + r * stride_src + offs, mask=m & (offs * 0 + r >= 0), other=0.0).to(tl.float32)
        if HAS_W:  # a skipped copy's weight may be anything (NaN too): it multiplies nothing
            v = v * tl.where(r >= 0, tl.load(w_ptr + s * J + j).to(tl.float32), 0.0)
        acc += v
    tl.store(out_ptr + s * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_d": 2048, "num_warps": 8}


def _block_d(D: int) -> int:
    return max(16, min(triton.next_power_of_2(max(D, 1)), CONFIG["block_d"]))


@kernel_op("spmdmoe::gather_sum", mutates_args=())
def gather_sum_triton(src_RD: torch.Tensor, index_MJ: torch.Tensor, weights_MJ: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton launcher (see the module docstring)."""
    M, J = index_MJ.shape
    D = src_RD.shape[1]
    src_RD = unit_rows(src_RD)
    index_MJ = index_MJ.contiguous()
    out_MD = torch.empty((M, D), dtype=src_RD.dtype, device=src_RD.device)
    w = weights_MJ.contiguous() if weights_MJ is not None else index_MJ
    if guard_or_true(M > 0) and D > 0:  # M: data-dependent under compile (EP); an empty grid launches nothing
        block = _block_d(D)
        wrap_triton(_gather_sum_kernel)[(M, triton.cdiv(D, block))](
            src_RD, index_MJ, w, out_MD, D, src_RD.stride(0), out_MD.stride(0),
            J=J, HAS_W=weights_MJ is not None, BLOCK_D=block, num_warps=CONFIG["num_warps"],
        )
    return out_MD


def gather_sum_reference(src_RD: torch.Tensor, index_MJ: torch.Tensor, weights_MJ: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, same signature and semantics as :func:`gather_sum_triton`: a batched
    ``(1, J) @ (J, D)`` product in fp32 (fp64 for fp64 rows)."""
    M, J = index_MJ.shape
    D = src_RD.shape[1]
    acc = torch.promote_types(src_RD.dtype, torch.float32)
    picked_MJD = src_RD.index_select(0, index_MJ.reshape(-1).clamp(min=0)).view(M, J, D).to(acc)
    picked_MJD = torch.where(index_MJ.unsqueeze(-1) >= 0, picked_MJD, 0)  # a skipped copy (-1) adds nothing
    w_MJ = torch.ones((M, J), dtype=acc, device=src_RD.device) if weights_MJ is None else weights_MJ.to(acc)
    w_MJ = torch.where(index_MJ >= 0, w_MJ, 0)
    # copy=True: a base tensor, never a view of the bmm's (callers, an MoE layer's output, may modify it in
    # place); not bmm(out=...), which makes Dynamo on torch 2.11 specialize M
    return torch.bmm(w_MJ.unsqueeze(1), picked_MJD).squeeze(1).to(src_RD.dtype, copy=True)


gather_sum = by_backend("gather_sum", gather_sum_triton, gather_sum_reference)
