"""Rowwise FP8 scale+cast in one pass: ``q[r] = e4m3(x[r] * 448 / amax_r)``, ``s[r] = amax_r / 448``.

Legend: ``R`` rows in the buffer (a capacity), ``C`` columns.

The activations of the FP8 experts (``spmdmoe.moe.experts.fp8``): the routed rows
before the up-projection, the SwiGLU output before the down-projection, and
the two row gradients of the backward (the weights: :mod:`spmdmoe.kernels.fp8_weights`).
Only the first ``valid`` rows are read (``valid`` a one-element device tensor, e.g.
``RoutedTokens.valid_rows``; ``None``: every row); rows past it of both outputs are left unspecified (the kernel
does not touch them; the reference writes zeros). The scale rule and the
rounding: :mod:`spmdmoe.kernels.fp8_common`; kernel and reference agree bit for bit.

Programs (``backend.row_programs``) stride over the valid rows, ``BLOCK_R`` at a
time. A row up to ``BLOCK_C`` columns is read once into registers (amax, scale,
cast from the same registers); wider rows are read twice, the second time from L1/L2.

Measured (H200, torch 2.11, Triton 3.6, bf16 in, R = 98,304 rows x C = 2048; ``benchmarks/kernels.py``;
bytes = bf16 read + e4m3 and fp32 scales written): 0.219 ms, 2.76 TB/s (66 % of the 4.2 TB/s copy
ceiling; torchao 0.18's ``triton_fp8_rowwise_2d_scale_and_cast`` on the same input: 0.590 ms, 1.02 TB/s);
C = 2816 (``dh13``): 0.307 ms, 2.71 TB/s. The launch configuration minimizes the two together (issue 23's
sweep: 0.501 ms against 0.561 for the one that gave 0.189 ms at C = 2048 alone).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import wrap_triton

from .backend import by_backend, kernel_op, row_programs
from .fp8_common import EPS_C, FP8, e4m3_inverse, e4m3_scale, quantize_reference, to_e4m3

__all__ = ["quantize_rows", "quantize_rows_reference", "quantize_rows_triton"]

# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_r": 2, "max_block_c": 1024, "num_warps": 4}


@triton.jit
def _rows_kernel(x_ptr, q_ptr, s_ptr, valid_ptr, R, C, HAS_VALID: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_TILE: tl.constexpr):
    if HAS_VALID:
        n = tl.minimum(tl.load(valid_ptr).to(tl.int64), R)
    else:
        n = tl.full([], R, tl.int64)
    for r0 in range(tl.program_id(0).to(tl.int64) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < n
        base = rows[:, None] * C
        cols = tl.arange(0, BLOCK_C)
        if ONE_TILE:
            m = live[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), EPS_C)
            inv = e4m3_inverse(amax)
            q = to_e4m3(x, inv[:, None])
            tl.store(q_ptr + base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        else:
            amax = tl.full([BLOCK_R], EPS_C, tl.float32)
            for c0 in range(0, C, BLOCK_C):
                m = live[:, None] & (c0 + cols < C)[None, :]
                x = tl.load(x_ptr + base + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            inv = e4m3_inverse(amax)
            for c0 in range(0, C, BLOCK_C):
                m = live[:, None] & (c0 + cols < C)[None, :]
                x = tl.load(x_ptr + base + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
                q = to_e4m3(x, inv[:, None])
                tl.store(q_ptr + base + c0 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + rows, e4m3_scale(amax), mask=live)


def _launch(x_RC: torch.Tensor, q_RC: torch.Tensor, s_R: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
    """``_rows_kernel`` over ``x_RC`` (inside the ``triton_op``: ``wrap_triton``)."""
    R, C = x_RC.shape
    if guard_or_true(R > 0) and C > 0:  # R: data-dependent under compile (EP); an empty grid launches nothing
        block_c = min(triton.next_power_of_2(C), CONFIG["max_block_c"])
        grid = (row_programs(triton.cdiv(R, CONFIG["block_r"]), x_RC.device),)
        wrap_triton(_rows_kernel)[grid](
            x_RC, q_RC, s_R, valid if valid is not None else s_R, R, C, HAS_VALID=valid is not None,
            BLOCK_R=CONFIG["block_r"], BLOCK_C=block_c, ONE_TILE=block_c >= C, num_warps=CONFIG["num_warps"])


@kernel_op("spmdmoe::quantize_rows", mutates_args=())
def quantize_rows_triton(x_RC: torch.Tensor, valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher: ``(q_RC e4m3, s_R fp32)``."""
    x_RC = x_RC.contiguous()
    R, C = x_RC.shape
    q_RC = torch.empty((R, C), dtype=FP8, device=x_RC.device)
    s_R = torch.empty((R,), dtype=torch.float32, device=x_RC.device)
    _launch(x_RC, q_RC, s_R, valid)
    return q_RC, s_R


def quantize_rows_reference(x_RC: torch.Tensor, valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same signature: every row quantized, then rows past ``valid`` zeroed (q and s)."""
    x = x_RC.float()
    q_RC, s_R = quantize_reference(x, x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1))
    s_R = s_R.reshape(-1)
    if valid is not None:
        live = torch.arange(x.shape[0], device=x.device) < valid.reshape(-1)[:1].to(x.device)
        q_RC = torch.where(live[:, None], q_RC.view(torch.uint8), 0).view(FP8)
        s_R = torch.where(live, s_R, 0.0)
    return q_RC, s_R


quantize_rows = by_backend("fp8_rows", quantize_rows_triton, quantize_rows_reference)

