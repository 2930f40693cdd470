"""FP8 rowwise routed experts (``MoEConfig(expert_precision="fp8_rowwise")``).

Legend: ``R`` routed rows in the buffer, ``D`` model dim, ``F`` expert hidden
dim (this rank's slice), ``e`` local experts, ``P`` rows of the 16-aligned
wgrad layout (:func:`spmdmoe.kernels.fp8_cols.padded_rows`).

The experts' three GEMMs run in e4m3 with fp32 scales (``torch._scaled_grouped_mm``,
fast accumulation, bf16 out); everything else (router, shared experts, combine,
master weights and their gradients) stays in the activations' precision:

* forward ``h13 = x @ [w1 | w3]^T`` and ``y = h @ w2^T``, dgrad ``dh = dy @ w2`` and
  ``dx = dh13 @ [w1 | w3]``: the row operand quantized per row straight from
  the routed buffer (valid rows only, :func:`spmdmoe.kernels.quantize_rows`;
  the SwiGLU's outputs ``h`` and ``dh13`` by the SwiGLU kernels themselves,
  :func:`spmdmoe.kernels.swiglu_quant_forward`), the weight per output column;
  any group size, no padding;
* wgrad ``dw2[g] = dy[g]^T @ h[g]`` and ``dw1|dw3[g] = dh13[g]^T @ x[g]``: both
  operands quantized per (group, column) by ONE launch that writes them
  transposed into a 16-row-aligned layout with zero pad rows
  (:func:`spmdmoe.kernels.quantize_cols_pair`): the only padding of the path.

Weights are quantized in the two layouts the GEMMs want, kept by the weight
cache until their bytes change (:mod:`spmdmoe.moe.fp8_cache`: checked on the
device before every use, so never stale), and the forward's quantized weights
are what its backward uses (saved, as autograd saves any operand).

Fast accumulation (:data:`FAST_ACCUM`) is on in all three GEMMs, as in torchao
0.18. Measured on an H200 (``benchmarks/fp8_numerics.py``): it lowers each
GEMM's own accumulation SQNR from 55.5 dB to 48-55 dB (48 at 16k rows per
expert in wgrad), noise 20 dB weaker than the e4m3 operands' (28.5 dB), so
each GEMM's total SQNR moves by at most 0.04 dB and the layer's gates keep the
same 1.5 dB margin (T = 300 and 16k, 1.5k and 4k rows per expert); precise
accumulation costs 6-33 % more GEMM time.

On CPU, on GPUs
without sm90 and for dims that are not multiples of 16 the same path runs
emulated: the same quantizers (their references on CPU), the same alignment,
then dequantize and an ordinary GEMM (bf16 for a bf16 layer on CUDA, fp32
elsewhere); a CUDA device takes that route with a one-time warning.

Forward and backward are two custom ops tied by ``register_autograd``, so
``torch.compile(fullgraph=True)`` sees them as opaque calls (their fake
implementations give the shapes) and compiled runs execute the very code
eager runs do.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional

import torch

from ..host import to_host
from ..kernels import quantize_cols_pair, quantize_rows, quantize_weight_cols, swiglu_backward, swiglu_quant_backward, swiglu_quant_forward
from .gemm import grouped_mm, up_weights

__all__ = ["FAST_ACCUM", "Fp8Weights", "fp8_native", "fp8_swiglu", "quantize_weights"]

_scaled = getattr(torch, "_scaled_grouped_mm", None)
# ``use_fast_accum`` of the scaled GEMMs, per kind: Hopper's FP8 tensor cores accumulate in reduced precision unless
# the GEMM promotes partial sums to fp32 (``False``: slower). Chosen by measurement (module docstring;
# ``benchmarks/fp8_numerics.py``, figures in ``benchmarks/RESULTS.md``).
FAST_ACCUM: dict[str, bool] = {"forward": True, "dgrad": True, "wgrad": True}
_grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_warned: list[bool] = [False]


def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def fp8_native(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs here: a CUDA device of sm90 or later, every GEMM dim a
    multiple of 16 (and some rows). Warns once when a CUDA device must emulate. Asked inside the experts'
    custom ops, so on real tensors, also under ``torch.compile``."""
    if not x.is_cuda or _scaled is None or x.shape[0] == 0:
        return False
    ok = _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()) and all(
        d % 16 == 0 and d > 0 for d in dims)
    if not ok and not _warned[0]:
        _warned[0] = True
        warnings.warn(f"fp8_rowwise experts need sm90+ and dims that are multiples of 16 (found {dims}); "
                      "emulating them (quantize, dequantize, an ordinary GEMM): FP8 numerics, no FP8 speed", stacklevel=3)
    return ok


class Fp8Weights(NamedTuple):
    """The quantized weights, in the GEMMs' column-major layouts (``(q, s)`` pairs, ``s`` fp32 per column).

    ``up`` = ``[w1 | w3]`` as ``(e, 2F, D)`` (forward: per (expert, hidden unit) over D); ``up_t`` its
    transpose ``(e, D, 2F)`` (dgrad: per (expert, model unit) over 2F); ``down`` = ``w2`` ``(e, D, F)``
    (forward, per (expert, model unit)); ``down_t`` its transpose ``(e, F, D)`` (dgrad)."""

    up: torch.Tensor
    up_s: torch.Tensor
    up_t: torch.Tensor
    up_t_s: torch.Tensor
    down: torch.Tensor
    down_s: torch.Tensor
    down_t: torch.Tensor
    down_t_s: torch.Tensor
    ready: Optional[torch.Tensor] = None  # the cache's refresh token (spmdmoe.moe.fp8_cache); None: fresh values


def _rows3(w_eAB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each ``(expert, row)`` of a 3-D weight over its last dim: ``(q_eAB, s_eA)``."""
    e, A, B = w_eAB.shape
    q, s = quantize_rows(w_eAB.reshape(e * A, B))
    return q.view(e, A, B), s.view(e, A)


def quantize_weights(w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor) -> Fp8Weights:
    """Both layouts of both weights (the transposed ones quantized per column, no transposing copy)."""
    with torch.no_grad():
        up = up_weights(w1_eFD, w3_eFD)
        return Fp8Weights(*_rows3(up), *quantize_weight_cols(up), *_rows3(w2_eDF), *quantize_weight_cols(w2_eDF))


def _mm_rows(q_MK: torch.Tensor, s_M: torch.Tensor, w_eNK: torch.Tensor, s_eN: torch.Tensor,
             offsets_e: torch.Tensor, out_dtype: torch.dtype, native: bool, kind: str) -> torch.Tensor:
    """``y[rows of g] = (q * s)[rows] @ (w[g] * s[g])^T`` (2-D x 3-D, any group sizes); ``kind``: "forward" or
    "dgrad" (:data:`FAST_ACCUM`)."""
    if native:
        y = _scaled(q_MK, w_eNK.transpose(1, 2), s_M, s_eN, offs=offsets_e, out_dtype=torch.bfloat16,
                    use_fast_accum=FAST_ACCUM[kind])
        return y.to(out_dtype)
    dt = _emulation_dtype(q_MK, out_dtype)
    x = (q_MK.to(torch.float32) * s_M[:, None]).to(dt)
    w = (w_eNK.to(torch.float32) * s_eN[:, :, None]).to(dt)
    return grouped_mm(x, w, offsets_e).to(out_dtype)


def _mm_groups(qa_AP: torch.Tensor, qb_BP: torch.Tensor, sa_eA: torch.Tensor, sb_eB: torch.Tensor,
               padded_e: torch.Tensor, out_dtype: torch.dtype, native: bool) -> torch.Tensor:
    """``out[g] = (a[g] * sa[g])^T-ish``: per group ``g``, ``qa[:, rows of g] @ qb[:, rows of g]^T`` scaled,
    ``(e, A, B)`` (2-D x 2-D, groups 16-aligned, pad rows zero)."""
    e = padded_e.shape[0]
    if native:
        out = _scaled(qa_AP, qb_BP.t(), sa_eA.reshape(-1), sb_eB.reshape(-1), offs=padded_e,
                      out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM["wgrad"])
        return out.to(out_dtype)
    if _emulation_dtype(qa_AP, out_dtype) == torch.bfloat16:  # e4m3 values are exact in bf16
        out = _grouped(qa_AP.to(torch.bfloat16), qb_BP.to(torch.bfloat16).t(), offs=padded_e)
        return (out.float() * sa_eA[:, :, None] * sb_eB[:, None, :]).to(out_dtype)
    a, b = qa_AP.to(torch.float32), qb_BP.to(torch.float32)
    ends = to_host(padded_e)  # emulation only (CPU, or fp32 on CUDA): the op runs eagerly, also when compiled
    starts = [0, *ends[:-1]]
    out = torch.stack([a[:, s:t] @ b[:, s:t].t() for s, t in zip(starts, ends)]) if e else \
        a.new_zeros((0, a.shape[0], b.shape[0]))
    return (out * sa_eA[:, :, None] * sb_eB[:, None, :]).to(out_dtype)


def _emulation_dtype(q: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """bf16 GEMMs for a bf16 layer on CUDA (torch's grouped GEMM, also under compile), fp32 elsewhere."""
    return torch.bfloat16 if q.is_cuda and out_dtype == torch.bfloat16 and _grouped is not None else torch.float32


def _native(x_RD: torch.Tensor, F: int) -> bool:
    return fp8_native(x_RD, x_RD.shape[1], F)


# The experts are two custom ops (forward, backward) tied by ``register_autograd``: opaque to Dynamo and
# AOTAutograd, so ``torch.compile(fullgraph=True)`` traces them through their fake implementations and runs
# the real ones as they are. (An ``autograd.Function`` traced into the graph gave zero gradients on CUDA with
# torch 2.11; this form keeps the numerics of eager and compiled runs identical by construction.)
@torch.library.custom_op("spmdmoe::fp8_experts", mutates_args=())
def _fp8_experts(x_RD: torch.Tensor, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor,
                 offsets_e: torch.Tensor, valid: torch.Tensor, up: torch.Tensor, up_s: torch.Tensor,
                 down: torch.Tensor, down_s: torch.Tensor, up_t: torch.Tensor, up_t_s: torch.Tensor,
                 down_t: torch.Tensor, down_t_s: torch.Tensor, ready: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y_RD, h13_R2F, h_RF)``: the output and the two activations the backward needs (the transposed
    weights ride along for the backward; ``ready`` orders the op after the cache's refresh, unused)."""
    native = _native(x_RD, w1_eFD.shape[1])
    h13_R2F = _mm_rows(*quantize_rows(x_RD, valid), up, up_s, offsets_e, x_RD.dtype, native, "forward")
    h_RF, hq, sh = swiglu_quant_forward(h13_R2F, valid)  # h for the w2 wgrad, hq for the GEMM
    return _mm_rows(hq, sh, down, down_s, offsets_e, x_RD.dtype, native, "forward"), h13_R2F, h_RF


@_fp8_experts.register_fake
def _(x_RD, w1_eFD, w2_eDF, w3_eFD, offsets_e, valid, *quantized):  # type: ignore[no-untyped-def]
    R, F = x_RD.shape[0], w1_eFD.shape[1]
    return x_RD.new_empty(x_RD.shape), x_RD.new_empty((R, 2 * F)), x_RD.new_empty((R, F))


@torch.library.custom_op("spmdmoe::fp8_experts_backward", mutates_args=())
def _fp8_experts_backward(g_RD: torch.Tensor, x_RD: torch.Tensor, h13_R2F: torch.Tensor, h_RF: torch.Tensor,
                          offsets_e: torch.Tensor, valid: torch.Tensor, up_t: torch.Tensor, up_t_s: torch.Tensor,
                          down_t: torch.Tensor, down_t_s: torch.Tensor, w_dtype: torch.dtype,
                          need_dx: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx_RD, dw1_eFD, dw2_eDF, dw3_eFD)``; ``dx`` empty when not ``need_dx``."""
    F = h_RF.shape[1]
    native = _native(x_RD, F)
    g_RD = g_RD.contiguous()
    # each temporary goes as soon as its GEMM is done (the peak is the step's peak)
    dh_RF = _mm_rows(*quantize_rows(g_RD, valid), down_t, down_t_s, offsets_e, g_RD.dtype, native, "dgrad")
    dx = g_RD.new_empty((0, x_RD.shape[1]))
    if need_dx:  # dh13 for the up-projection's wgrad, its rowwise e4m3 for the dgrad GEMM
        dh13_R2F, dq, sd = swiglu_quant_backward(dh_RF, h13_R2F, valid)
        del dh_RF
        dx = _mm_rows(dq, sd, up_t, up_t_s, offsets_e, g_RD.dtype, native, "dgrad")
        del dq
    else:
        dh13_R2F = swiglu_backward(dh_RF, h13_R2F, valid)
        del dh_RF
    # wgrad: both operands of each GEMM quantized per (group, column) by one launch, 16-aligned
    dw2 = _mm_groups(*quantize_cols_pair(g_RD, h_RF, offsets_e), w_dtype, native)
    q13, qx, s13, sx_eD, padded_e = quantize_cols_pair(dh13_R2F, x_RD, offsets_e)
    del dh13_R2F
    dw1 = _mm_groups(q13[:F], qx, s13[:, :F].contiguous(), sx_eD, padded_e, w_dtype, native)
    dw3 = _mm_groups(q13[F:], qx, s13[:, F:].contiguous(), sx_eD, padded_e, w_dtype, native)
    return dx, dw1, dw2, dw3


@_fp8_experts_backward.register_fake
def _(g_RD, x_RD, h13_R2F, h_RF, offsets_e, valid, up_t, up_t_s, down_t, down_t_s, w_dtype, need_dx):  # type: ignore[no-untyped-def]
    (R, D), F, e = x_RD.shape, h_RF.shape[1], offsets_e.shape[0]
    dx = g_RD.new_empty((R if need_dx else 0, D))
    return (dx, g_RD.new_empty((e, F, D), dtype=w_dtype), g_RD.new_empty((e, D, F), dtype=w_dtype),
            g_RD.new_empty((e, F, D), dtype=w_dtype))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x_RD, w1_eFD, _, _, offsets_e, valid = inputs[:6]
    _, h13_R2F, h_RF = output
    ctx.w_dtype = w1_eFD.dtype
    ctx.save_for_backward(x_RD, h13_R2F, h_RF, offsets_e, valid, *inputs[10:14])


def _backward(ctx: Any, g_RD: torch.Tensor, _g13: Any, _gh: Any) -> tuple:
    dx, dw1, dw2, dw3 = _fp8_experts_backward(g_RD, *ctx.saved_tensors, ctx.w_dtype, ctx.needs_input_grad[0])
    return (dx if ctx.needs_input_grad[0] else None, dw1, dw2, dw3) + (None,) * 11


_fp8_experts.register_autograd(_backward, setup_context=_setup)


def fp8_swiglu(x_RD: torch.Tensor, offsets_e: torch.Tensor, valid: torch.Tensor, w1_eFD: torch.Tensor,
               w2_eDF: torch.Tensor, w3_eFD: torch.Tensor, quantized: Fp8Weights) -> torch.Tensor:
    """``y_RD`` of the routed rows ``[0, valid)`` through the FP8 experts (rows past ``valid``: unspecified).
    ``quantized``: the weights' FP8 copies (``Fp8WeightCache.get`` or :func:`quantize_weights`)."""
    q = quantized
    ready = q.ready if q.ready is not None else x_RD.new_empty(0)
    return _fp8_experts(x_RD, w1_eFD, w2_eDF, w3_eFD, offsets_e, valid, q.up, q.up_s, q.down, q.down_s,
                        q.up_t, q.up_t_s, q.down_t, q.down_t_s, ready)[0]
