"""SwiGLU and the rowwise FP8 quantization of its result, fused: one read of the inputs, no re-read of the output.

Legend: ``R`` rows in the buffer (a capacity), ``F`` expert hidden dim; ``h13_R2F``
= ``[h1 | h3]`` as in :mod:`spmdmoe.kernels.swiglu`.

The FP8 experts (``spmdmoe.moe.experts.fp8``) need both precisions of the SwiGLU's
output: ``h`` in bf16 (saved for the weight gradient of ``w2``) and in e4m3 per
row (the down-projection's operand). Unfused, the rowwise quantizer reads ``h``
back from memory; here the SwiGLU kernel quantizes the row it just computed,
from registers. The e4m3 values quantize the *rounded* output (bf16 for a bf16
layer), so the result equals :func:`swiglu_forward` followed by
:func:`quantize_rows` bit for bit, with or without the routing weights
(``w_R``: ``h = w * silu(h1) * h3``, the combine's weights folded in).

:func:`swiglu_quant_forward` returns ``(h_RF, q_RF, s_R)``. Its backward is the plain
:func:`spmdmoe.kernels.swiglu_backward`.

Only the first ``valid`` rows (a one-element device tensor) are read or written; rows past it of every
output are unspecified (the references write zeros). Programs (``backend.row_programs``) stride over the
valid rows, ``BLOCK_R`` whole rows at a time; a row wider than ``BLOCK_F`` is computed twice (the second
time from L2) rather than read back.

Measured (H200, torch 2.11, Triton 3.6, bf16, R = 98,304 rows, F = 1408; ``benchmarks/kernels.py``):
0.311 ms, 3.11 TB/s (74 % of the 4.2 TB/s copy ceiling; bytes = bf16 read + bf16, e4m3 and fp32 scales
written), 1.34x the SwiGLU kernel followed by the rowwise quantizer (0.416 ms).

:func:`swiglu_quant_backward` does the same for the backward: ``dh13`` in bf16 (the weight gradient's
operand) and its rowwise e4m3 over all ``2F`` columns (the input gradient's), with the routing weights'
gradient; ``dh13`` bit for bit :func:`spmdmoe.kernels.swiglu_backward`'s (one formula,
:func:`spmdmoe.kernels.swiglu.swiglu_grads`), ``(q, s)`` bit for bit the rowwise quantizer's of it. A row
wider than ``BLOCK_F`` takes two passes: the first writes ``dh13`` and finds the amax, the second reads
the row back (from L2, after a barrier; ``reload``) or recomputes it, and writes the e4m3. Measured (same
set-up, weights folded): 0.483 ms, 3.44 TB/s (82 %), 1.42x the weighted SwiGLU backward followed by the
rowwise quantizer on ``dh13`` (0.684 ms); recomputing instead of reading back: 0.618 ms.
:func:`swiglu_quant_backward_` writes the e4m3 over ``g``'s bytes instead of a new buffer (a 2-byte row of
``F`` is exactly an e4m3 row of ``2F``): the FP8 experts' backward, where ``g`` is read for the last time.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_true
from torch.library import wrap_triton

from .backend import by_backend, kernel_op, row_programs, use_triton
from .fp8_common import EPS_C, FP8, e4m3_inverse, e4m3_scale, to_e4m3
from .fp8_rows import quantize_rows_reference
from .swiglu import (_valid_mask, chunk, load_pair, row_weights, swiglu_backward_reference, swiglu_forward_reference,
                     swiglu_grads)

__all__ = [
    "swiglu_quant_forward", "swiglu_quant_forward_reference", "swiglu_quant_forward_triton",
    "swiglu_quant_backward", "swiglu_quant_backward_reference", "swiglu_quant_backward_triton",
    "swiglu_quant_backward_", "swiglu_quant_backward_inplace_reference", "swiglu_quant_backward_inplace_triton",
]

# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block_r": 1, "max_block_f": 2048, "num_warps": 4}
BWD_CONFIG = {"block_r": 2, "max_block_f": 512, "num_warps": 4, "reload": True}


@triton.jit
def _amax(v):
    """``max |v|`` per row of ``v`` (the output dtype), fp32."""
    return tl.max(tl.abs(v.to(tl.float32)), axis=1)


@triton.jit
def _fwd_values(h13_ptr, at, m, F, w, HAS_W: tl.constexpr, OUT_TY: tl.constexpr):
    """``h`` of one chunk in the output dtype (times the row weights ``w``)."""
    a, b = load_pair(h13_ptr, at, m, F)
    h = a * tl.sigmoid(a) * b
    if HAS_W:
        h = h * w[:, None]
    return h.to(OUT_TY)


@triton.jit
def _bwd_values(g_ptr, h13_ptr, rows, cols, at, m, F, w, HAS_W: tl.constexpr, OUT_TY: tl.constexpr):
    """``(dh1, dh3, dot)`` of one chunk, the gradients in the output dtype, ``dot`` the chunk's share of each
    row's routing-weight gradient (fp32)."""
    a, b = load_pair(h13_ptr, at, m, F)
    g = tl.load(g_ptr + rows[:, None] * F + cols[None, :], mask=m, other=0.0).to(tl.float32)
    d1, d3, dot = swiglu_grads(g, a, b, w, HAS_W)
    return d1.to(OUT_TY), d3.to(OUT_TY), dot


@triton.jit
def _row_block(r0, n, BLOCK_R: tl.constexpr):
    """The program's rows from ``r0``: ``(rows, live, amax)``, ``amax`` starting at EPS."""
    rows = r0 + tl.arange(0, BLOCK_R)
    return rows, rows < n, tl.full([BLOCK_R], EPS_C, tl.float32)


@triton.jit
def _fwd_kernel(h13_ptr, h_ptr, q_ptr, s_ptr, valid_ptr, w_ptr, F, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_F: tl.constexpr, ONE_TILE: tl.constexpr):
    n = tl.load(valid_ptr).to(tl.int64)
    for r0 in range(tl.program_id(0).to(tl.int64) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        rows, live, amax = _row_block(r0, n, BLOCK_R)
        w = row_weights(w_ptr, rows, live, HAS_W, BLOCK_R)
        OUT_TY = h_ptr.dtype.element_ty
        if ONE_TILE:
            cols, m, at = chunk(rows, live, 0, F, BLOCK_F)
            h = _fwd_values(h13_ptr, at, m, F, w, HAS_W, OUT_TY)
            tl.store(h_ptr + rows[:, None] * F + cols[None, :], h, mask=m)
            amax = tl.maximum(amax, _amax(h))
            inv = e4m3_inverse(amax)
            tl.store(q_ptr + rows[:, None] * F + cols[None, :],
                     to_e4m3(h.to(tl.float32), inv[:, None]).to(q_ptr.dtype.element_ty), mask=m)
        else:
            for c0 in range(0, F, BLOCK_F):
                cols, m, at = chunk(rows, live, c0, F, BLOCK_F)
                h = _fwd_values(h13_ptr, at, m, F, w, HAS_W, OUT_TY)
                tl.store(h_ptr + rows[:, None] * F + cols[None, :], h, mask=m)
                amax = tl.maximum(amax, _amax(h))
            inv = e4m3_inverse(amax)
            for c0 in range(0, F, BLOCK_F):
                cols, m, at = chunk(rows, live, c0, F, BLOCK_F)
                h = _fwd_values(h13_ptr, at, m, F, w, HAS_W, OUT_TY)
                tl.store(q_ptr + rows[:, None] * F + cols[None, :],
                         to_e4m3(h.to(tl.float32), inv[:, None]).to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + rows, e4m3_scale(amax), mask=live)


@triton.jit
def _bwd_kernel(g_ptr, h13_ptr, d13_ptr, q_ptr, s_ptr, dw_ptr, valid_ptr, w_ptr, F, HAS_W: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, ONE_TILE: tl.constexpr, RELOAD: tl.constexpr):
    n = tl.load(valid_ptr).to(tl.int64)
    for r0 in range(tl.program_id(0).to(tl.int64) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        rows, live, amax = _row_block(r0, n, BLOCK_R)
        w = row_weights(w_ptr, rows, live, HAS_W, BLOCK_R)
        OUT_TY = d13_ptr.dtype.element_ty
        if ONE_TILE:
            cols, m, at = chunk(rows, live, 0, F, BLOCK_F)
            d1, d3, dot = _bwd_values(g_ptr, h13_ptr, rows, cols, at, m, F, w, HAS_W, OUT_TY)
            tl.store(d13_ptr + at, d1, mask=m)
            tl.store(d13_ptr + at + F, d3, mask=m)
            amax = tl.maximum(amax, tl.maximum(_amax(d1), _amax(d3)))
            inv = e4m3_inverse(amax)[:, None]
            tl.store(q_ptr + at, to_e4m3(d1.to(tl.float32), inv).to(q_ptr.dtype.element_ty), mask=m)
            tl.store(q_ptr + at + F, to_e4m3(d3.to(tl.float32), inv).to(q_ptr.dtype.element_ty), mask=m)
        else:
            dot = tl.zeros([BLOCK_R], tl.float32)
            for c0 in range(0, F, BLOCK_F):
                cols, m, at = chunk(rows, live, c0, F, BLOCK_F)
                d1, d3, part = _bwd_values(g_ptr, h13_ptr, rows, cols, at, m, F, w, HAS_W, OUT_TY)
                tl.store(d13_ptr + at, d1, mask=m)
                tl.store(d13_ptr + at + F, d3, mask=m)
                amax = tl.maximum(amax, tl.maximum(_amax(d1), _amax(d3)))
                dot += part
            inv = e4m3_inverse(amax)[:, None]
            if RELOAD:  # read back what this program just wrote (L2), after a barrier that makes it visible
                tl.debug_barrier()
            for c0 in range(0, F, BLOCK_F):  # else recomputed from the inputs (L2)
                cols, m, at = chunk(rows, live, c0, F, BLOCK_F)
                if RELOAD:
                    d1 = tl.load(d13_ptr + at, mask=m, other=0.0)
                    d3 = tl.load(d13_ptr + at + F, mask=m, other=0.0)
                else:
                    d1, d3, part = _bwd_values(g_ptr, h13_ptr, rows, cols, at, m, F, w, HAS_W, OUT_TY)
                tl.store(q_ptr + at, to_e4m3(d1.to(tl.float32), inv).to(q_ptr.dtype.element_ty), mask=m)
                tl.store(q_ptr + at + F, to_e4m3(d3.to(tl.float32), inv).to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + rows, e4m3_scale(amax), mask=live)
        if HAS_W:
            tl.store(dw_ptr + rows, dot, mask=live)


def _launch(R: int, F: int, config: dict, device: torch.device) -> tuple[tuple[int], dict]:
    block_f = min(triton.next_power_of_2(F), config["max_block_f"])
    extra = {"RELOAD": config["reload"]} if "reload" in config else {}
    return (row_programs(triton.cdiv(R, config["block_r"]), device),), {
        "BLOCK_R": config["block_r"], "BLOCK_F": block_f, "ONE_TILE": block_f >= F, "num_warps": config["num_warps"],
        **extra}


@kernel_op("spmdmoe::swiglu_quant_forward", mutates_args=())
def swiglu_quant_forward_triton(h13_R2F: torch.Tensor, valid: torch.Tensor, w_R: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton launcher: ``(h_RF, q_RF e4m3, s_R fp32)``; ``w_R``: each row's routing weight (fp32) or ``None``."""
    h13_R2F = h13_R2F.contiguous()
    R, F = h13_R2F.shape[0], h13_R2F.shape[1] // 2
    h_RF = h13_R2F.new_empty((R, F))
    q_RF = torch.empty((R, F), dtype=FP8, device=h13_R2F.device)
    s_R = torch.empty((R,), dtype=torch.float32, device=h13_R2F.device)
    if guard_or_true(R > 0) and F > 0:  # R: data-dependent under compile (EP); an empty grid launches nothing
        grid, meta = _launch(R, F, CONFIG, h13_R2F.device)
        wrap_triton(_fwd_kernel)[grid](h13_R2F, h_RF, q_RF, s_R, valid, w_R if w_R is not None else s_R, F,
                                       HAS_W=w_R is not None, **meta)
    return h_RF, q_RF, s_R


@kernel_op("spmdmoe::swiglu_quant_backward", mutates_args=())
def swiglu_quant_backward_triton(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                                 w_R: Optional[torch.Tensor] = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton launcher of the backward: ``(dh13_R2F, q_R2F e4m3, s_R fp32, dw_R fp32)``: the SwiGLU's input
    gradient, its rowwise e4m3 over all ``2F`` columns with the scales, and the routing weights' gradient
    (empty without ``w_R``). ``g_RF``: the output gradient; ``h13_R2F``, ``valid``, ``w_R``: the forward's."""
    g_RF = g_RF.contiguous()
    q_R2F = torch.empty((g_RF.shape[0], 2 * g_RF.shape[1]), dtype=FP8, device=g_RF.device)
    d13_R2F, s_R, dw_R = _bwd_launch(g_RF, h13_R2F, q_R2F, valid, w_R, reload=BWD_CONFIG["reload"])
    return d13_R2F, q_R2F, s_R, dw_R


@kernel_op("spmdmoe::swiglu_quant_backward_", mutates_args=("g_RF",))
def swiglu_quant_backward_inplace_triton(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                                         w_R: Optional[torch.Tensor] = None
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_quant_backward_triton` writing the e4m3 over ``g_RF``'s bytes (a bf16 / fp16 row of ``F``
    holds exactly an e4m3 row of ``2F``; each program writes only its own rows, after it has read them):
    ``(dh13_R2F, s_R, dw_R)``, and ``g_RF.view(e4m3)`` (``R x 2F``) then holds ``q`` (rows past ``valid``
    unchanged). Saves the ``R x 2F`` e4m3 output where ``g`` is not needed after, as in the FP8 experts'
    backward; ``g`` is an intermediate there, so a compiled graph reuses it in place (a mutated graph input
    would be copied first)."""
    _check_inplace(g_RF)
    return _bwd_launch(g_RF, h13_R2F, g_RF.view(FP8), valid, w_R, reload=True)


def _check_inplace(g_RF: torch.Tensor) -> None:
    if not g_RF.is_contiguous() or g_RF.element_size() != 2:
        raise ValueError("swiglu_quant_backward_ writes the e4m3 of dh13 over g: g must be a contiguous 2-byte "
                         f"float tensor, found dtype {g_RF.dtype}, strides {g_RF.stride()}; use "
                         "swiglu_quant_backward (out of place)")


def _bwd_launch(g_RF: torch.Tensor, h13_R2F: torch.Tensor, q_R2F: torch.Tensor, valid: torch.Tensor,
                w_R: Optional[torch.Tensor], reload: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: ``(dh13_R2F, s_R, dw_R)`` allocated here, the e4m3 into ``q_R2F``; ``reload``:
    a multi-tile row's second pass reads its stored ``dh13`` back (required when ``q_R2F`` is ``g``'s
    storage: recomputing would read ``g`` after it was overwritten)."""
    h13_R2F = h13_R2F.contiguous()
    R, F = g_RF.shape
    d13_R2F = torch.empty_like(h13_R2F)
    s_R = torch.empty((R,), dtype=torch.float32, device=h13_R2F.device)
    dw_R = torch.empty((R if w_R is not None else 0,), dtype=torch.float32, device=h13_R2F.device)
    if guard_or_true(R > 0) and F > 0:  # R: data-dependent under compile (EP); an empty grid launches nothing
        grid, meta = _launch(R, F, {**BWD_CONFIG, "reload": reload}, g_RF.device)
        wrap_triton(_bwd_kernel)[grid](g_RF, h13_R2F, d13_R2F, q_R2F, s_R, dw_R, valid,
                                       w_R if w_R is not None else s_R, F, HAS_W=w_R is not None, **meta)
    return d13_R2F, s_R, dw_R


def swiglu_quant_forward_reference(h13_R2F: torch.Tensor, valid: torch.Tensor, w_R: Optional[torch.Tensor] = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature: the SwiGLU reference, then the rowwise quantizer's (zeros past ``valid``)."""
    h_RF = swiglu_forward_reference(h13_R2F, valid, w_R)
    return (h_RF, *quantize_rows_reference(h_RF, valid))


def swiglu_quant_backward_reference(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                                    w_R: Optional[torch.Tensor] = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature: the SwiGLU backward's reference, then the rowwise quantizer's of ``dh13``."""
    d13_R2F, dw_R = swiglu_backward_reference(g_RF, h13_R2F, valid, w_R)
    return (d13_R2F, *quantize_rows_reference(d13_R2F, valid), dw_R)


def swiglu_quant_backward_inplace_reference(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                                            w_R: Optional[torch.Tensor] = None
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same signature: the out-of-place reference, its e4m3 copied over ``g``'s bytes on the valid rows."""
    _check_inplace(g_RF)
    d13_R2F, q_R2F, s_R, dw_R = swiglu_quant_backward_reference(g_RF, h13_R2F, valid, w_R)
    bytes_R2F = g_RF.view(torch.uint8)
    bytes_R2F.copy_(torch.where(_valid_mask(bytes_R2F, valid), q_R2F.view(torch.uint8), bytes_R2F))
    return d13_R2F, s_R, dw_R


swiglu_quant_forward = by_backend("swiglu_fp8", swiglu_quant_forward_triton, swiglu_quant_forward_reference)


swiglu_quant_backward = by_backend("swiglu_fp8", swiglu_quant_backward_triton, swiglu_quant_backward_reference, probe=1)


def swiglu_quant_backward_(g_RF: torch.Tensor, h13_R2F: torch.Tensor, valid: torch.Tensor,
                           w_R: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place (the e4m3 over ``g``'s bytes): the Triton kernel on CUDA, the reference elsewhere. Returns what
    :func:`swiglu_quant_backward` returns, ``q`` being ``g_RF.view(e4m3)``."""
    impl = (swiglu_quant_backward_inplace_triton if use_triton("swiglu_fp8", h13_R2F)
            else swiglu_quant_backward_inplace_reference)
    d13_R2F, s_R, dw_R = impl(g_RF, h13_R2F, valid, w_R)
    return d13_R2F, g_RF.view(FP8), s_R, dw_R
