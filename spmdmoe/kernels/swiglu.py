"""Offset-aware SwiGLU over expert-major rows: ``h = silu(h1) * h3`` and its backward.

Legend: ``R`` rows in the buffer (a capacity), ``F`` expert hidden dim.

Only the first ``valid`` rows are valid, ``valid`` read from device memory
(``RoutedTokens.valid_rows``, the last group offset): the kernels never read
or write a row past it, so a capacity-sized buffer may hold anything there
(NaN included) and no host sync is needed to know the count. Rows past
``valid`` of the outputs are left unspecified (the Triton kernels do not touch
them; the reference writes zeros). Math in fp32, one rounding per output:
forward ``h = h1 * sigmoid(h1) * h3``; backward ``dh3 = g * silu(h1)``,
``dh1 = g * h3 * sigmoid(h1) * (1 + h1 * (1 - sigmoid(h1)))``.

Measured (H200, bf16, F=1408): see ``benchmarks/RESULTS.md`` (kernels),
reported against the 4.2 TB/s copy ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .backend import use_triton

__all__ = [
    "swiglu_forward", "swiglu_forward_reference", "swiglu_forward_triton",
    "swiglu_backward", "swiglu_backward_reference", "swiglu_backward_triton",
]

_BLOCK = 2048


@triton.jit
def _swiglu_fwd_kernel(h1_ptr, h3_ptr, out_ptr, valid_ptr, F, BLOCK: tl.constexpr):
    n = tl.load(valid_ptr).to(tl.int64) * F
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start < n:
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        a = tl.load(h1_ptr + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(h3_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, h1_ptr, h3_ptr, dh1_ptr, dh3_ptr, valid_ptr, F, BLOCK: tl.constexpr):
    n = tl.load(valid_ptr).to(tl.int64) * F
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start < n:
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        a = tl.load(h1_ptr + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(h3_ptr + offs, mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        tl.store(dh3_ptr + offs, (g * a * sig).to(dh3_ptr.dtype.element_ty), mask=m)
        tl.store(dh1_ptr + offs, (g * b * sig * (1.0 + a * (1.0 - sig))).to(dh1_ptr.dtype.element_ty), mask=m)


def _grid(h_RF: torch.Tensor) -> tuple[int]:
    return (triton.cdiv(h_RF.numel(), _BLOCK),)


@triton_op("spmdmoe::swiglu_forward", mutates_args=())
def swiglu_forward_triton(h1_RF: torch.Tensor, h3_RF: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The Triton launcher; ``valid``: a one-element integer device tensor (rows ``[0, valid)``)."""
    h1_RF, h3_RF = h1_RF.contiguous(), h3_RF.contiguous()
    out_RF = torch.empty_like(h1_RF)
    if h1_RF.numel() > 0:
        wrap_triton(_swiglu_fwd_kernel)[_grid(h1_RF)](h1_RF, h3_RF, out_RF, valid, h1_RF.shape[1], BLOCK=_BLOCK,
                                                        num_warps=8)
    return out_RF


@triton_op("spmdmoe::swiglu_backward", mutates_args=())
def swiglu_backward_triton(
    g_RF: torch.Tensor, h1_RF: torch.Tensor, h3_RF: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher of the backward: ``(dh1, dh3)``."""
    g_RF, h1_RF, h3_RF = g_RF.contiguous(), h1_RF.contiguous(), h3_RF.contiguous()
    dh1_RF, dh3_RF = torch.empty_like(h1_RF), torch.empty_like(h3_RF)
    if h1_RF.numel() > 0:
        wrap_triton(_swiglu_bwd_kernel)[_grid(h1_RF)](g_RF, h1_RF, h3_RF, dh1_RF, dh3_RF, valid, h1_RF.shape[1],
                                                        BLOCK=_BLOCK, num_warps=8)
    return dh1_RF, dh3_RF


def _valid_mask(h_RF: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(R, 1)`` bool: row < valid (on the device, no host read)."""
    rows = torch.arange(h_RF.shape[0], device=h_RF.device)
    return (rows < valid.reshape(-1)[:1].to(rows.device)).unsqueeze(1)


def swiglu_forward_reference(h1_RF: torch.Tensor, h3_RF: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Plain torch, same signature: computed on every row in fp32, zeros past ``valid``."""
    a = h1_RF.to(torch.promote_types(h1_RF.dtype, torch.float32))
    h = torch.nn.functional.silu(a) * h3_RF.to(a.dtype)
    return torch.where(_valid_mask(h1_RF, valid), h, 0.0).to(h1_RF.dtype)


def swiglu_backward_reference(
    g_RF: torch.Tensor, h1_RF: torch.Tensor, h3_RF: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same signature as :func:`swiglu_backward_triton`: zeros past ``valid``."""
    acc = torch.promote_types(h1_RF.dtype, torch.float32)
    g, a, b = g_RF.to(acc), h1_RF.to(acc), h3_RF.to(acc)
    sig = torch.sigmoid(a)
    keep = _valid_mask(h1_RF, valid)
    dh3 = torch.where(keep, g * a * sig, 0.0).to(h3_RF.dtype)
    dh1 = torch.where(keep, g * b * sig * (1 + a * (1 - sig)), 0.0).to(h1_RF.dtype)
    return dh1, dh3


def swiglu_forward(h1_RF: torch.Tensor, h3_RF: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on CUDA, the reference elsewhere (``spmdmoe.kernels.backend``)."""
    impl = swiglu_forward_triton if use_triton("swiglu", h1_RF) else swiglu_forward_reference
    return impl(h1_RF, h3_RF, valid)


def swiglu_backward(
    g_RF: torch.Tensor, h1_RF: torch.Tensor, h3_RF: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the reference elsewhere (``spmdmoe.kernels.backend``)."""
    impl = swiglu_backward_triton if use_triton("swiglu", h1_RF) else swiglu_backward_reference
    return impl(g_RF, h1_RF, h3_RF, valid)
