"""Offset-aware SwiGLU over expert-major rows: ``h = silu(h1) * h3`` from ``h13 = [h1 | h3]``, and its backward.

Legend: ``R`` rows in the buffer (a capacity), ``F`` expert hidden dim; ``h13_R2F``
holds ``h1`` in columns ``[0, F)`` and ``h3`` in ``[F, 2F)`` (the output of the
one fused up-projection GEMM, ``spmdmoe.moe.experts.grouped``).

Only the first ``valid`` rows are valid, ``valid`` read from device memory
(``RoutedTokens.valid_rows``, the last group offset): the kernels never read
or write a row past it, so a capacity-sized buffer may hold anything there
(NaN included) and no host sync is needed to know the count. Rows past
``valid`` of the outputs are left unspecified (the Triton kernels do not touch
them; the reference writes zeros). Math in fp32, one rounding per output:
forward ``h = h1 * sigmoid(h1) * h3``; backward ``dh3 = g * silu(h1)``,
``dh1 = g * h3 * sigmoid(h1) * (1 + h1 * (1 - sigmoid(h1)))``. The programs
(``backend.row_programs`` of them for each block of ``BLOCK_F`` columns) stride
over the valid rows, ``BLOCK_R`` at a time: none is launched for the rows past it.

Measured (H200, torch 2.11, Triton 3.6, bf16, R = 98,304 rows, F = 1408; ``benchmarks/kernels.py``):
forward 0.209 ms, 3.97 TB/s (95 % of the 4.2 TB/s copy ceiling); backward 0.348 ms, 3.98 TB/s (95 %);
with the routing weights folded in (and their row dots) backward 0.399 ms, 3.47 TB/s (83 %). The launch
configuration is swept on the forward and the weighted backward together (the local transport's pair):
0.573 ms, against 0.636 with the previous one (8 rows x 512 columns, 8 warps). The bounded grid against a program
a row, one process (H200, 2026-11-30): forward 202.7 against 195.8 us, weighted backward 403.3 against 382.4.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import wrap_triton

from .backend import by_backend, cast, kernel_op, row_programs

__all__ = [
    "swiglu_forward", "swiglu_forward_reference", "swiglu_forward_triton",
    "swiglu_backward", "swiglu_backward_reference", "swiglu_backward_triton", "swiglu_grads", "chunk", "load_pair",
    "row_weights",
]

# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_r": 1, "block_f": 2048, "num_warps": 4}


@triton.jit
def chunk(rows, live, c0, F, BLOCK_F: tl.constexpr):
    """Columns ``[c0, c0 + BLOCK_F)`` of ``rows`` (``live``: the rows below the valid count): ``(cols, mask,
    h1's offsets in h13)``. Index helpers take no pointer, pointer helpers (:func:`load_pair`,
    :func:`row_weights`) return loaded values only: torch's write analysis counts a helper's results as
    derived from all of its arguments, so offsets returned by a helper that took a pointer would mark that
    pointer written (and inductor would copy the tensor before the launch; ``tests/test_kernel_writes.py``)."""
    cols = c0 + tl.arange(0, BLOCK_F)
    m = live[:, None] & (cols < F)[None, :]
    return cols, m, rows[:, None] * (2 * F) + cols[None, :]


@triton.jit
def load_pair(h13_ptr, at, m, F):
    """``h1``, ``h3`` at ``h1``'s offsets ``at`` (masked by ``m``), fp32: loaded values only (see :func:`chunk`)."""
    a = tl.load(h13_ptr + at, mask=m, other=0.0).to(tl.float32)
    b = tl.load(h13_ptr + at + F, mask=m, other=0.0).to(tl.float32)
    return a, b


@triton.jit
def row_weights(w_ptr, rows, live, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr):
    """The rows' folded routing weights, fp32 (a placeholder without them): loaded values only."""
    w = tl.zeros([BLOCK_R], tl.float32)  # unused without weights
    if HAS_W:
        w = tl.load(w_ptr + rows, mask=live, other=0.0).to(tl.float32)
    return w


@triton.jit
def swiglu_grads(g, a, b, w, HAS_W: tl.constexpr):
    """fp32 ``(dh1, dh3, dot)`` of a tile: the gradients of ``w * silu(a) * b`` for the output gradient ``g``
    (``w``: the rows' routing weights, one per row, when ``HAS_W``), and each row's dot ``<g, silu(a) * b>``,
    the weight's gradient (zeros without weights). One formula for every SwiGLU backward kernel, so the
    fused ones round exactly as this module's."""
    sig = tl.sigmoid(a)
    dot = tl.zeros([g.shape[0]], tl.float32)
    if HAS_W:
        dot = tl.sum(g * (a * sig * b), axis=1)
        g = g * w[:, None]
    return g * b * sig * (1.0 + a * (1.0 - sig)), g * a * sig, dot


@triton.jit
def _swiglu_fwd_kernel(h13_ptr, out_ptr, valid_ptr, w_ptr, F, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_F: tl.constexpr):
    n = tl.load(valid_ptr).to(tl.int64)
    for r0 in range(tl.program_id(0).to(tl.int64) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < n
        cols, m, at = chunk(rows, live, tl.program_id(1) * BLOCK_F, F, BLOCK_F)
        a, b = load_pair(h13_ptr, at, m, F)
        h = a * tl.sigmoid(a) * b
        if HAS_W:
            h = h * row_weights(w_ptr, rows, live, HAS_W, BLOCK_R)[:, None]
        tl.store(out_ptr + rows[:, None] * F + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, h13_ptr, d13_ptr, valid_ptr, w_ptr, dots_ptr, F, HAS_W: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    n = tl.load(valid_ptr).to(tl.int64)
    for r0 in range(tl.program_id(0).to(tl.int64) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < n
        cols, m, at = chunk(rows, live, tl.program_id(1) * BLOCK_F, F, BLOCK_F)
        a, b = load_pair(h13_ptr, at, m, F)
        g = tl.load(g_ptr + rows[:, None] * F + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = row_weights(w_ptr, rows, live, HAS_W, BLOCK_R)
        d1, d3, dot = swiglu_grads(g, a, b, w, HAS_W)
        if HAS_W:  # the routing weight's gradient: this block's share of the row dot
            tl.store(dots_ptr + rows * tl.num_programs(1) + tl.program_id(1), dot, mask=live)
        tl.store(d13_ptr + at, d1.to(d13_ptr.dtype.element_ty), mask=m)
        tl.store(d13_ptr + at + F, d3.to(d13_ptr.dtype.element_ty), mask=m)


def _grid(R: int, F: int, device: torch.device) -> tuple[int, int]:
    return (row_programs(triton.cdiv(R, CONFIG["block_r"]), device), triton.cdiv(F, CONFIG["block_f"]))


@kernel_op("spmdmoe::swiglu_forward", mutates_args=())
def swiglu_forward_triton(h13_R2F: torch.Tensor, valid: torch.Tensor, w_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton launcher; ``valid``: a one-element integer device tensor (rows ``[0, valid)``); ``w_R``: the
    routing weight of each row (fp32), or ``None``."""
    h13_R2F = h13_R2F.contiguous()
    R, F = h13_R2F.shape[0], h13_R2F.shape[1] // 2
    out_RF = h13_R2F.new_empty((R, F))
    if guard_or_true(R > 0) and F > 0:  # R: data-dependent under compile (EP); an empty grid launches nothing
        wrap_triton(_swiglu_fwd_kernel)[_grid(R, F, h13_R2F.device)](
            h13_R2F, out_RF, valid, w_R if w_R is not None else valid, F, HAS_W=w_R is not None,
            BLOCK_R=CONFIG["block_r"], BLOCK_F=CONFIG["block_f"], num_warps=CONFIG["num_warps"])
    return out_RF


@kernel_op("spmdmoe::swiglu_backward", mutates_args=())
def swiglu_backward_triton(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                           w_R: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher of the backward: ``(dh13 = [dh1 | dh3], dw_R)`` (``dw_R`` fp32, empty without
    ``w_R``): each row's block sums land in their own slots, summed in a fixed order after."""
    g_RF, h13_R2F = g_RF.contiguous(), h13_R2F.contiguous()
    R, F = g_RF.shape
    d13_R2F = torch.empty_like(h13_R2F)
    blocks = triton.cdiv(F, CONFIG["block_f"]) if F > 0 else 0
    parts = torch.empty((R if w_R is not None else 0, blocks), dtype=torch.float32, device=g_RF.device)
    if guard_or_true(R > 0) and F > 0:  # R: data-dependent under compile (EP); an empty grid launches nothing
        wrap_triton(_swiglu_bwd_kernel)[_grid(R, F, g_RF.device)](
            g_RF, h13_R2F, d13_R2F, valid, w_R if w_R is not None else valid, parts, F, HAS_W=w_R is not None,
            BLOCK_R=CONFIG["block_r"], BLOCK_F=CONFIG["block_f"], num_warps=CONFIG["num_warps"])
    return d13_R2F, (parts.sum(dim=1) if w_R is not None else parts.new_empty(0))


def _valid_mask(h_R: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(R, 1)`` bool: row < valid (on the device, no host read)."""
    rows = torch.arange(h_R.shape[0], device=h_R.device)
    return (rows < valid.reshape(-1)[:1].to(rows.device)).unsqueeze(1)


def swiglu_forward_reference(h13_R2F: torch.Tensor, valid: torch.Tensor, w_R: Optional[torch.Tensor] = None
                             ) -> torch.Tensor:
    """Plain torch, same signature: computed on every row in fp32, zeros past ``valid``."""
    acc = torch.promote_types(h13_R2F.dtype, torch.float32)
    a, b = h13_R2F.to(acc).chunk(2, dim=1)
    h = torch.nn.functional.silu(a) * b
    if w_R is not None:
        h = h * w_R.to(acc)[:, None]
    return cast(torch.where(_valid_mask(h13_R2F, valid), h, 0.0), h13_R2F.dtype)


def swiglu_backward_reference(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                              w_R: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same signature as :func:`swiglu_backward_triton`: zeros past ``valid``."""
    acc = torch.promote_types(h13_R2F.dtype, torch.float32)
    a, b = h13_R2F.to(acc).chunk(2, dim=1)
    g = g_RF.to(acc)
    sig = torch.sigmoid(a)
    live = _valid_mask(h13_R2F, valid)
    dw = g.new_zeros(0)
    if w_R is not None:
        dw = torch.where(live[:, 0], (g * (a * sig * b)).sum(dim=1), 0.0)
        g = g * w_R.to(acc)[:, None]
    d13 = torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=1)
    return cast(torch.where(live, d13, 0.0), h13_R2F.dtype), dw


swiglu_forward = by_backend("swiglu", swiglu_forward_triton, swiglu_forward_reference)


swiglu_backward = by_backend("swiglu", swiglu_backward_triton, swiglu_backward_reference, probe=1)
