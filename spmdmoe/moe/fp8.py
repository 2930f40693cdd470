"""FP8 rowwise routed experts (``MoEConfig(expert_precision="fp8_rowwise")``).

Legend: ``T`` tokens, ``K`` top-k, ``R`` routed rows in the buffer, ``D`` model dim, ``F`` expert hidden
dim (this rank's slice), ``e`` local experts, ``P`` rows of the 16-aligned
wgrad layout (:func:`spmdmoe.kernels.fp8_cols.padded_rows`), ``M`` rows of a GEMM, ``I`` / ``O`` a
projection's input (reduced) and output width (as in ``gemm.py``), ``A`` / ``B`` the widths of a weight
gradient's two operands.

The experts' forward and input-gradient GEMMs run in e4m3 with fp32 scales
(``torch._scaled_grouped_mm``, fast accumulation, bf16 out), their weight-gradient
GEMMs in FP8 or unquantized (:func:`fp8_wgrad`); everything else (router, shared
experts, combine, master weights and their gradients) stays in the activations'
precision. One autograd node whose backward frees each activation as soon as it
has read it, so none lives longer than in the bf16 layer (measured at the five
shape presets, H200: the eager step peak 3-13 % below the bf16 layer's; compiled,
at or below it at three, 2.4 % above at Qwen3-30B-A3B and 64k tokens, where
``dh13``'s or ``dy``'s e4m3 sits beside a weight gradient's output; at small
token counts the eager peak can exceed the bf16 layer's by a few percent;
``benchmarks/RESULTS.md``, issue 23):

* forward: ``h13 = x @ [w1 | w3]^T`` on ``x``'s rowwise e4m3 (made by every
  transport's dispatch in its fan-out pass, once per (received) token:
  ``RoutedTokens.fp8_rows``; without it: quantized here,
  :func:`spmdmoe.kernels.quantize_rows`), an op of its own
  before the autograd node, so ``x``'s e4m3 is dead before the down projection
  allocates; ``h = w * silu(h1) * h3`` (``w`` the routing weight when the dispatch folded it in) and ``h``'s
  rowwise e4m3 from the same registers (:func:`spmdmoe.kernels.swiglu_quant_forward`);
  ``y = h @ w2^T`` on that e4m3, and with the weights folded (``RoutedTokens.copies_TK``,
  every transport) each (received) token's copies summed. Kept for the
  backward: the bf16 ``x``, ``h13`` and ``h``.
* backward, weight gradients before input gradients: ``dy`` fanned out to each
  token's copies with its rowwise e4m3, quantized once per token in the same pass
  (:func:`spmdmoe.kernels.fan_out_fp8`; with FP8 weight gradients the e4m3 only after
  ``dw2``, so it never coexists with the column-quantized operands; per row without
  ``copies_TK``); ``dw2``, drop the copies and ``h``; ``dh = dy @ w2`` on the e4m3; the SwiGLU backward writes ``dh13``
  and its rowwise e4m3 (over ``dh``'s bytes) in one pass, its row dot giving the routing
  weight's gradient (:func:`spmdmoe.kernels.swiglu_quant_backward_`), drop ``h13``; ``dw1``,
  ``dw3``, drop ``dh13`` and ``x``; ``dx = dh13 @ [w1 | w3]`` on the e4m3 (a compiled graph may run it
  before ``dw1 | dw3``).

The activations are kept in a box on the node, not saved, so the backward can drop
them as it goes: a second backward through the same forward (``retain_graph=True``)
raises and says so.

The weights enter per output column (forward) and per input column (dgrad):
both layouts are quantized when the weights change and kept by the weight
cache (:mod:`spmdmoe.moe.fp8_cache`: checked on the device before every use, so
never stale); the forward's quantized weights are what its backward uses.
Forward and dgrad take any group size, no padding.

Weight gradients (:func:`fp8_wgrad`, ``MoEConfig.fp8_wgrad``): in FP8 both operands of
``dw2[g] = dy[g]^T h[g]`` and ``dw1|dw3[g] = dh13[g]^T x[g]`` are quantized per
(group, column) into a 16-row-aligned transposed layout (a hot expert split across programs) with
zero pad rows (:func:`spmdmoe.kernels.quantize_cols_pair`, the only padding of
the path), and the bf16 operands are dropped before the GEMM; unquantized,
torch's grouped GEMM takes the bf16 operands as they are.
The per-(group, column) quantizers read every operand twice (1.5 TB/s counted)
and the 2-D x 2-D scaled GEMM gains only 1.08-1.13x over bf16 at 1-2k rows per
expert, so at small ``D F / (2 D + 3 F)`` the unquantized wgrad is faster (H200,
``benchmarks/RESULTS.md``, issue 23); ``"auto"`` decides from ``D`` and ``F`` only
(:data:`WGRAD_FP8_MIN`), never from the token count (one graph, no host sync).

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

The node is a custom op tied to its backward by ``register_autograd``, and the
backward's GEMMs are custom ops too, so ``torch.compile(fullgraph=True)`` sees
opaque calls (their fake implementations give the shapes) and compiled runs
execute the very code eager runs do.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional

import torch

from ..host import to_host
from ..kernels import (fan_out, fan_out_fp8, gather_sum, quantize_cols_pair, quantize_rows, quantize_weight_pair,
                       swiglu_quant_backward, swiglu_quant_backward_, swiglu_quant_forward)
from ..kernels.fp8_common import FP8
from .gemm import grouped_mm, up_weights

__all__ = ["FAST_ACCUM", "WGRAD_FP8_MIN", "Fp8Weights", "fp8_native", "fp8_swiglu", "fp8_wgrad", "quantize_weights"]

_scaled = getattr(torch, "_scaled_grouped_mm", None)
# ``use_fast_accum`` of the scaled GEMMs, per kind: Hopper's FP8 tensor cores accumulate in reduced precision unless
# the GEMM promotes partial sums to fp32 (``False``: slower). Chosen by measurement (module docstring;
# ``benchmarks/fp8_numerics.py``, figures in ``benchmarks/RESULTS.md``).
FAST_ACCUM: dict[str, bool] = {"forward": True, "dgrad": True, "wgrad": True}
# ``fp8_wgrad="auto"``: the weight gradients run in FP8 where ``D F / (2 D + 3 F)`` (GEMM work per byte the
# wgrad quantizers move) reaches this; below it the unquantized wgrad GEMMs are faster than FP8 GEMMs plus the
# per-(group, column) quantizers (measured at every shape preset: module docstring, ``benchmarks/RESULTS.md``).
WGRAD_FP8_MIN = 600.0
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


def quantize_weights(w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor) -> Fp8Weights:
    """Both layouts of both weights (the transposed ones quantized per column, no transposing copy; two reads
    of each weight, :func:`spmdmoe.kernels.quantize_weight_pair`)."""
    with torch.no_grad():
        up = up_weights(w1_eFD, w3_eFD)
        return Fp8Weights(*quantize_weight_pair(up), *quantize_weight_pair(w2_eDF))


def _mm_rows(q_MI: torch.Tensor, s_M: torch.Tensor, w_eOI: torch.Tensor, s_eO: torch.Tensor,
             offsets_e: torch.Tensor, out_dtype: torch.dtype, native: bool, kind: str) -> torch.Tensor:
    """``y[rows of g] = (q * s)[rows] @ (w[g] * s[g])^T`` (2-D x 3-D, any group sizes); ``kind``: "forward" or
    "dgrad" (:data:`FAST_ACCUM`)."""
    if native:
        y = _scaled(q_MI, w_eOI.transpose(1, 2), s_M, s_eO, offs=offsets_e, out_dtype=torch.bfloat16,
                    use_fast_accum=FAST_ACCUM[kind])
        return y.to(out_dtype)
    dt = _emulation_dtype(q_MI, out_dtype)
    x = (q_MI.to(torch.float32) * s_M[:, None]).to(dt)
    w = (w_eOI.to(torch.float32) * s_eO[:, :, None]).to(dt)
    return grouped_mm(x, w, offsets_e).to(out_dtype)


def _mm_groups(qa_AP: torch.Tensor, qb_BP: torch.Tensor, sa_eA: torch.Tensor, sb_eB: torch.Tensor,
               padded_e: torch.Tensor, out_dtype: torch.dtype, native: bool) -> torch.Tensor:
    """``out[g] = (a[g] * sa[g])^T-ish``: per group ``g``, ``qa[:, rows of g] @ qb[:, rows of g]^T`` scaled,
    ``(e, A, B)`` (2-D x 2-D, groups 16-aligned, pad rows zero)."""
    if native:
        out = _scaled(qa_AP, qb_BP.t(), sa_eA.reshape(-1), sb_eB.reshape(-1), offs=padded_e,
                      out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM["wgrad"])
        return out.to(out_dtype)
    if _emulation_dtype(qa_AP, out_dtype) == torch.bfloat16:  # e4m3 values are exact in bf16
        out = _grouped(qa_AP.to(torch.bfloat16), qb_BP.to(torch.bfloat16).t(), offs=padded_e)
        return (out.float() * sa_eA[:, :, None] * sb_eB[:, None, :]).to(out_dtype)
    out = _per_group(qa_AP.to(torch.float32), qb_BP.to(torch.float32), padded_e)
    return (out * sa_eA[:, :, None] * sb_eB[:, None, :]).to(out_dtype)


def _per_group(a_AP: torch.Tensor, b_BP: torch.Tensor, ends_e: torch.Tensor) -> torch.Tensor:
    """``out[g] = a[:, cols of g] @ b[:, cols of g]^T`` by one GEMM per group on the host's group ends
    (emulation only: CPU, or fp32 on CUDA; the op runs eagerly, also when compiled)."""
    ends = to_host(ends_e)
    starts = [0, *ends[:-1]]
    if not ends:
        return a_AP.new_zeros((0, a_AP.shape[0], b_BP.shape[0]))
    return torch.stack([a_AP[:, s:t] @ b_BP[:, s:t].t() for s, t in zip(starts, ends)])


def _emulation_dtype(q: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """bf16 GEMMs for a bf16 layer on CUDA (torch's grouped GEMM, also under compile), fp32 elsewhere."""
    return torch.bfloat16 if q.is_cuda and out_dtype == torch.bfloat16 and _grouped is not None else torch.float32


def _wgrad_plain(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Unquantized weight gradient ``out[g] = a[rows of g]^T @ b[rows of g]``, ``(e, A, B)``: torch's grouped
    GEMM (2-D x 2-D, any group sizes, rows past ``offsets[-1]`` never read) where it runs, else per-group
    GEMMs in fp32 on the host's group ends (emulation only)."""
    e = offsets_e.shape[0]
    if a_RA.shape[0] == 0:  # no rows at all (torch's kernel refuses a zero-length contraction)
        return a_RA.new_zeros((e, a_RA.shape[1], b_RB.shape[1]), dtype=out_dtype)
    if _grouped is not None and a_RA.is_cuda and a_RA.dtype == torch.bfloat16 == b_RB.dtype and \
            (a_RA.shape[1] * 2) % 16 == 0 and (b_RB.shape[1] * 2) % 16 == 0:
        return _grouped(a_RA.t(), b_RB, offs=offsets_e).to(out_dtype)
    return _per_group(a_RA.to(torch.float32).t(), b_RB.to(torch.float32).t(), offsets_e).to(out_dtype)


def fp8_wgrad(D: int, F: int, e: int, dtype: torch.dtype, setting: str = "auto") -> bool:
    """Whether the weight-gradient GEMMs run in FP8 (``setting`` ``"auto"``: by :data:`WGRAD_FP8_MIN`; else
    ``"fp8"`` / ``"bf16"``). A function of the layer's shape only, never of the token count: one graph,
    no host sync, for every T. ``e`` and ``dtype`` are part of the rule's signature (measured at the
    shapes of ``benchmarks/shapes.py``; the rule found no use for them so far)."""
    if setting != "auto":
        return setting == "fp8"
    return D * F / (2 * D + 3 * F) >= WGRAD_FP8_MIN


def _parts(A: int, split: int) -> list[tuple[int, int]]:
    """The column ranges of the weight gradients in one ``A``-wide operand: all, or ``[0, split)`` and ``[split, A)``."""
    return [(0, A)] if not split else [(0, split), (split, A)]


def _wgrad_fp8(qa_AP: torch.Tensor, qb_BP: torch.Tensor, sa_eA: torch.Tensor, sb_eB: torch.Tensor,
               padded_e: torch.Tensor, out_dtype: torch.dtype, native: bool, split: int = 0) -> list[torch.Tensor]:
    """``a^T @ b`` per group from both operands quantized per (group, column) (:func:`quantize_cols_pair`)."""
    return [_mm_groups(qa_AP[i:j], qb_BP, sa_eA[:, i:j].contiguous(), sb_eB, padded_e, out_dtype, native)
            for i, j in _parts(qa_AP.shape[0], split)]


def _wgrad_bf16(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor, out_dtype: torch.dtype,
                split: int = 0) -> list[torch.Tensor]:
    """``a^T @ b`` per group, unquantized."""
    return [_wgrad_plain(a_RA[:, i:j], b_RB, offsets_e, out_dtype) for i, j in _parts(a_RA.shape[1], split)]


@torch.library.custom_op("spmdmoe::fp8_mm_rows", mutates_args=())
def _fp8_mm(q_RI: torch.Tensor, s_R: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, offsets_e: torch.Tensor,
            out_dtype: torch.dtype, dims: list[int], kind: str, after: Optional[torch.Tensor]) -> torch.Tensor:
    """``q @ w[g]^T`` per group ``g`` on rowwise e4m3 ``(q, s)`` and a weight layout of :class:`Fp8Weights`
    (``kind``: ``"forward"``, the up projection, or ``"dgrad"``, an input gradient; :data:`FAST_ACCUM`);
    ``dims``: the layer's ``(D, F)`` (native or emulated: asked here, on real tensors, also when compiled);
    ``after``: a tensor that must be made first, not read (the weight cache's refresh token before the up
    projection; the weight gradient before ``dh``, so a compiled graph frees the bf16 operands first, as
    eager runs do), or ``None``."""
    return _mm_rows(q_RI, s_R, w, w_s, offsets_e, out_dtype, fp8_native(q_RI, *dims), kind)


@_fp8_mm.register_fake
def _(q_RI, s_R, w, w_s, offsets_e, out_dtype, dims, kind, after):  # type: ignore[no-untyped-def]
    return q_RI.new_empty((q_RI.shape[0], w.shape[1]), dtype=out_dtype)


# The experts past the up projection are ONE autograd node whose backward frees each saved activation as soon as
# it has read it: a node per projection would hold its incoming gradient for all of its backward (the engine's
# reference), and handing the SwiGLU backward's e4m3 ``dh13`` to the up-projection's node would need a second
# gradient channel. The up projection itself (:func:`_fp8_mm`) runs before the node, outside autograd (``x``'s
# gradient comes from the node's backward): so ``x``'s e4m3, its only input, is dead before the down projection
# allocates, in compiled graphs too (an input of the node would be alive through all of it). The node is a
# custom op tied to its backward by ``register_autograd``; the backward's GEMMs are custom ops too
# (:func:`_fp8_mm`, :func:`_wgrad_bf16_op`, :func:`_wgrad_fp8_op`): opaque to Dynamo and AOTAutograd, so
# ``torch.compile(fullgraph=True)`` traces them through their fake implementations and runs the real ones as
# they are. (An ``autograd.Function`` traced into the graph gave zero gradients on CUDA with torch 2.11; this
# form keeps the numerics of eager and compiled runs identical by construction.) The down projection's weights
# are read after the cache's refresh because ``h13`` is (the up projection takes the refresh token).
@torch.library.custom_op("spmdmoe::fp8_experts", mutates_args=())
def _fp8_experts(x_RD: torch.Tensor, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor,
                 offsets_e: torch.Tensor, valid: torch.Tensor, h13_R2F: torch.Tensor, up_t: torch.Tensor,
                 up_t_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, down_t: torch.Tensor,
                 down_t_s: torch.Tensor, wgrad_fp8: bool, w_R: Optional[torch.Tensor],
                 copies_TK: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h_RF)`` from the up projection's ``h13_R2F``: ``h = w * silu(h1) * h3`` with its rowwise e4m3
    from the same registers, ``y_RD = h @ w2^T`` on that e4m3; ``y`` is ``y_RD``, or ``y_TD`` (each token's
    copies summed) with ``copies_TK``. Only ``y`` has a gradient; ``h`` is returned for the backward; ``x``
    (not read here) takes the input gradient."""
    h_RF, hq_RF, hs_R = swiglu_quant_forward(h13_R2F, valid, w_R)
    y_RD = _mm_rows(hq_RF, hs_R, down, down_s, offsets_e, x_RD.dtype,
                    fp8_native(h13_R2F, x_RD.shape[1], w1_eFD.shape[1]), "forward")
    del hq_RF, hs_R  # before the combine allocates its output
    return (y_RD if copies_TK is None else gather_sum(y_RD, copies_TK)), h_RF


@_fp8_experts.register_fake
def _(x_RD, w1_eFD, w2_eDF, w3_eFD, offsets_e, valid, h13_R2F, *rest):  # type: ignore[no-untyped-def]
    (R, D), F, copies_TK = x_RD.shape, w1_eFD.shape[1], rest[-1]
    return x_RD.new_empty((R if copies_TK is None else copies_TK.shape[0], D)), x_RD.new_empty((R, F))


@torch.library.custom_op("spmdmoe::wgrad_bf16", mutates_args=())
def _wgrad_bf16_op(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor, w_dtype: torch.dtype,
                   split: int) -> list[torch.Tensor]:
    """The weight gradients ``a^T @ b`` per group, unquantized; ``split`` > 0: two of them, ``a``'s columns
    ``[0, split)`` and ``[split, A)``."""
    return _wgrad_bf16(a_RA.contiguous(), b_RB, offsets_e, w_dtype, split)


@_wgrad_bf16_op.register_fake
def _(a_RA, b_RB, offsets_e, w_dtype, split):  # type: ignore[no-untyped-def]
    e, B = offsets_e.shape[0], b_RB.shape[1]
    return [a_RA.new_empty((e, j - i, B), dtype=w_dtype) for i, j in _parts(a_RA.shape[1], split)]


@torch.library.custom_op("spmdmoe::wgrad_fp8", mutates_args=())
def _wgrad_fp8_op(qa_AP: torch.Tensor, qb_BP: torch.Tensor, sa_eA: torch.Tensor, sb_eB: torch.Tensor,
                  padded_e: torch.Tensor, w_dtype: torch.dtype, split: int, dims: list[int]) -> list[torch.Tensor]:
    """The weight gradients from both operands quantized per (group, column) (:func:`quantize_cols_pair`);
    ``dims``: the layer's ``(D, F)`` (native or emulated, as the forward)."""
    return _wgrad_fp8(qa_AP, qb_BP, sa_eA, sb_eB, padded_e, w_dtype, fp8_native(qb_BP.t(), *dims), split)


@_wgrad_fp8_op.register_fake
def _(qa_AP, qb_BP, sa_eA, sb_eB, padded_e, w_dtype, split, dims):  # type: ignore[no-untyped-def]
    e, B = padded_e.shape[0], qb_BP.shape[0]
    return [qa_AP.new_empty((e, j - i, B), dtype=w_dtype) for i, j in _parts(qa_AP.shape[0], split)]


@torch.library.custom_op("spmdmoe::fp8_quantize_dy", mutates_args=())
def _quantize_dy(g: torch.Tensor, copies_TK: Optional[torch.Tensor], rows: int, valid: torch.Tensor,
                 after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy``'s rowwise e4m3 and scales for the down-projection's input gradient: each token's once for its
    ``K`` copies (``g`` is ``dy_TD``, ``copies_TK`` its rows; :func:`fan_out_fp8` without the bf16 copies) or
    per row (``g`` is ``dy_RD``). ``after``: ``dw2`` (not read), so a compiled graph makes these only once the
    weight gradient has freed its operands, as eager runs do."""
    if copies_TK is None:
        return quantize_rows(g, valid)
    _, q_RD, s_R = fan_out_fp8(g, copies_TK, rows, copies=False)
    return q_RD, s_R


@_quantize_dy.register_fake
def _(g, copies_TK, rows, valid, after):  # type: ignore[no-untyped-def]
    return g.new_empty((rows, g.shape[1]), dtype=FP8), g.new_empty((rows,), dtype=torch.float32)


def _weight_grads(operands: list[torch.Tensor], offsets_e: torch.Tensor, ctx: Any,
                  split: int = 0) -> list[torch.Tensor]:
    """The weight gradients ``a^T @ b`` of ``operands = [a, b]`` (emptied here: with FP8 weight gradients the bf16
    operands are freed once quantized, before the GEMM allocates its output), in FP8 or unquantized."""
    a_RA, b_RB = operands
    operands.clear()
    if not ctx.wgrad_fp8:
        return _wgrad_bf16_op(a_RA, b_RB, offsets_e, ctx.w_dtype, split)
    q = quantize_cols_pair(a_RA.contiguous(), b_RB, offsets_e)
    del a_RA, b_RB
    return _wgrad_fp8_op(*q, ctx.w_dtype, split, ctx.dims)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x_RD, w1_eFD, _, _, offsets_e, valid, h13_R2F, up_t, up_t_s, _, _, down_t, down_t_s, wgrad_fp8, w_R, copies_TK = inputs
    ctx.w_dtype, ctx.wgrad_fp8, ctx.dims = w1_eFD.dtype, wgrad_fp8, [x_RD.shape[1], w1_eFD.shape[1]]
    ctx.save_for_backward(offsets_e, valid, up_t, up_t_s, down_t, down_t_s, w_R, copies_TK)
    # The activations in a box, not saved: the backward drops each once it has read it, so none is alive
    # longer than in the bf16 layer (detached aliases: no reference back to this node).
    ctx.box = {"x": x_RD.detach(), "h13": h13_R2F.detach(), "h": output[1].detach()}
    ctx.set_materialize_grads(False)  # h13 and h get no gradient: no zero-filled one either


def _grad(ctx: Any, g: Optional[torch.Tensor], _gh: Any) -> tuple:
    """The backward, in the order that frees each activation soonest (the weight gradients before the input
    gradients, so the bf16 operands are gone before the input gradient is allocated): down (``dy``'s copies and
    its rowwise e4m3, once per token with ``copies_TK``, the e4m3 after ``dw2`` with FP8 weight gradients;
    ``dw2``; drop the copies and ``h``; ``dh``), SwiGLU (``dh13`` and its rowwise e4m3, over ``dh``, in one pass;
    drop ``h13``), up (``dw1``, ``dw3``; drop ``dh13``, ``x``; ``dx``). ``dh`` (and ``dy``'s e4m3 when made
    after ``dw2``) take ``dw2`` as an (unread) argument, so a compiled graph keeps that order too; ``dx`` is left
    to the graph."""
    if g is None:
        return (None,) * 16
    offsets_e, valid, up_t, up_t_s, down_t, down_t_s, w_R, copies_TK = ctx.saved_tensors
    if not ctx.box:
        raise RuntimeError("spmdmoe FP8 experts: a second backward through the same forward (retain_graph=True): "
                           "the first freed the saved activations as it went, to keep the step peak at the bf16 "
                           "layer's. Run the forward again for each backward, or use expert_precision='bf16'.")
    x_RD, h13_R2F, h_RF = ctx.box.pop("x"), ctx.box.pop("h13"), ctx.box.pop("h")
    ctx.box.clear()
    dims, dtype, R, g = ctx.dims, h_RF.dtype, h_RF.shape[0], g.contiguous()
    q: list[torch.Tensor] = []
    if copies_TK is None:
        g_RD = g
    elif ctx.wgrad_fp8:  # dy's e4m3 after dw2: never alive beside the column-quantized wgrad operands
        g_RD = fan_out(g, copies_TK, R)[0]
    else:  # the copies and their e4m3 from one read of dy (measured: making the e4m3 after dw2 instead costs
        # 0.14 ms per step at Qwen3-30B-A3B, and lowers the compiled peak only at 64k tokens, by 0.19 GiB)
        g_RD, *q = fan_out_fp8(g, copies_TK, R)
    operands = [g_RD, h_RF]
    del g_RD, h_RF
    (dw2,) = _weight_grads(operands, offsets_e, ctx)
    gq_RD, gs_R = q or _quantize_dy(g, copies_TK, R, valid, dw2)
    del q
    dh_RF = _fp8_mm(gq_RD, gs_R, down_t, down_t_s, offsets_e, dtype, dims, "dgrad", dw2)
    del gq_RD, gs_R
    # dh13's e4m3 written over dh (read for the last time here; a 2-byte row of F holds an e4m3 row of 2F): one
    # R x 2F buffer less at this point, eager and compiled alike (dh is made in this backward, so a compiled
    # graph reuses it in place; h13, a saved input of the backward graph, would be copied first)
    bwd = swiglu_quant_backward_ if dh_RF.element_size() == 2 else swiglu_quant_backward
    g13_R2F, q13_R2F, s13_R, dw_R = bwd(dh_RF, h13_R2F, valid, w_R)
    del dh_RF, h13_R2F
    operands = [g13_R2F, x_RD]
    del g13_R2F, x_RD
    dw1, dw3 = _weight_grads(operands, offsets_e, ctx, dims[1])
    # dx last (the node holds it until it returns); unordered against dw1 | dw3 in a compiled graph, whose
    # scheduler then picks (measured: forcing dx first there raised the compiled peak at four of five shapes, as
    # the dispatch's backward does not consume it at once; forcing it after dw1 | dw3 raised it at Qwen3-235B)
    dx = _fp8_mm(q13_R2F, s13_R, up_t, up_t_s, offsets_e, dtype, dims, "dgrad", None) if ctx.needs_input_grad[0] \
        else None
    dw = dw_R.to(w_R.dtype) if w_R is not None and ctx.needs_input_grad[14] else None
    return (dx, dw1, dw2, dw3) + (None,) * 10 + (dw, None)


_fp8_experts.register_autograd(_grad, setup_context=_setup)


def fp8_swiglu(x_RD: torch.Tensor, offsets_e: torch.Tensor, valid: torch.Tensor, w1_eFD: torch.Tensor,
               w2_eDF: torch.Tensor, w3_eFD: torch.Tensor, quantized: Fp8Weights, wgrad: str = "auto",
               x_fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               w_R: Optional[torch.Tensor] = None, copies_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y_RD`` of the routed rows ``[0, valid)`` through the FP8 experts (rows past ``valid``: unspecified).
    ``quantized``: the weights' FP8 copies (``Fp8WeightCache.get`` or :func:`quantize_weights`); ``wgrad``:
    ``"auto"``, ``"fp8"`` or ``"bf16"`` (:func:`fp8_wgrad`); ``x_fp8``: ``x``'s rowwise e4m3 and scales
    when the dispatch made them (``RoutedTokens.fp8_rows``), bit for bit ``quantize_rows(x_RD)``; ``w_R``:
    each row's routing weight when the dispatch folded them in (the SwiGLU output row times it);
    ``copies_TK``: the rows of each token's copies (``RoutedTokens.copies_TK``): ``y_TD``, the sum of each
    token's copies, instead (the combine inside the experts' node, whose backward then quantizes each
    token's output gradient once for its ``K`` copies)."""
    q, dims = quantized, [x_RD.shape[1], w1_eFD.shape[1]]
    in_fp8 = fp8_wgrad(x_RD.shape[1], w1_eFD.shape[1], w1_eFD.shape[0], x_RD.dtype, wgrad)
    xq, xs = x_fp8 or quantize_rows(x_RD.detach(), valid)
    h13_R2F = _fp8_mm(xq, xs, q.up, q.up_s, offsets_e, x_RD.dtype, dims, "forward", q.ready)
    del xq, xs
    y, _ = _fp8_experts(x_RD, w1_eFD, w2_eDF, w3_eFD, offsets_e, valid, h13_R2F, q.up_t, q.up_t_s, q.down, q.down_s,
                        q.down_t, q.down_t_s, in_fp8, w_R, copies_TK)
    return y
