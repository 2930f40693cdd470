"""The FP8 experts' custom ops, their fake implementations and their autograd, and :func:`fp8_swiglu`, the call that
runs them (the path, its numerics and its measured memory: ``fp8.py``'s docstring, ``docs/design.md`` §7.1).

Legend: as ``fp8.py``: ``R`` routed rows, ``D`` model dim, ``F`` expert hidden dim, ``e`` local experts,
``P`` rows of the 16-aligned wgrad layout, ``M`` rows of a GEMM, ``I`` / ``O`` a projection's input and output
width, ``A`` / ``B`` the widths of a weight gradient's two operands, ``T`` tokens, ``K`` top-k.

==========================  ============================================================================
op (``spmdmoe::``)          what
==========================  ============================================================================
``fp8_mm_rows``             rowwise e4m3 rows times a weight layout per group (up projection, dgrads)
``fp8_experts``             the node past the up projection: SwiGLU, down projection (its backward below)
``wgrad_bf16``              the weight gradients, unquantized
``wgrad_fp8``               the weight gradients from per-(group, column) e4m3 operands
``fp8_quantize_dy``         the output gradient's rowwise e4m3
==========================  ============================================================================

The experts' op takes its inputs, and its backward returns their gradients, by name
(:class:`ExpertsInputs`, checked against the op's signature at import), never by position.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Optional

import torch

from ...kernels import fan_out, fan_out_fp8, gather_sum, quantize_cols_pair, quantize_rows, swiglu_quant_backward, \
    swiglu_quant_backward_, swiglu_quant_forward
from ...kernels.fp8_common import FP8
from . import fp8 as gemms
from .fp8 import Fp8Weights

__all__ = ["fp8_swiglu", "ExpertsInputs"]


class ExpertsInputs(NamedTuple):
    """The inputs of ``spmdmoe::fp8_experts``, in its order; its backward's gradients use the same names."""

    x_RD: torch.Tensor  # the routed rows (takes the input gradient; not read in the forward)
    w1_eFD: torch.Tensor  # the bf16 weights (their gradients)
    w2_eDF: torch.Tensor
    w3_eFD: torch.Tensor
    offsets_e: torch.Tensor  # int32 group ends
    valid: torch.Tensor  # int32 (): rows [0, valid) are live
    h13_R2F: torch.Tensor  # the up projection's output (fp8_mm_rows)
    up_t: torch.Tensor  # the dgrad layouts and the forward's down layout (Fp8Weights)
    up_t_s: torch.Tensor
    down: torch.Tensor
    down_s: torch.Tensor
    down_t: torch.Tensor
    down_t_s: torch.Tensor
    wgrad_fp8: bool  # the weight gradients in FP8 (fp8.fp8_wgrad)
    watched: list[bool]  # which of w1, w2, w3 the node saves for their version counters (fp8_swiglu)
    w_R: Optional[torch.Tensor]  # each row's routing weight (takes its gradient), or None
    copies_TK: Optional[torch.Tensor]  # each token's rows (the output is y_TD), or None


@torch.library.custom_op("spmdmoe::fp8_mm_rows", mutates_args=())
def _fp8_mm(q_RI: torch.Tensor, s_R: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, offsets_e: torch.Tensor,
            out_dtype: torch.dtype, dims: list[int], kind: str, after: list[torch.Tensor]) -> torch.Tensor:
    """``q @ w[g]^T`` per group ``g`` on rowwise e4m3 ``(q, s)`` and a weight layout of :class:`Fp8Weights`
    (``kind``: ``"forward"``, the up projection, or ``"dgrad"``, an input gradient; :data:`FAST_ACCUM`);
    ``dims``: the layer's ``(D, F)`` (native or emulated: asked here, on real tensors, also when compiled);
    ``after``: tensors that must be made first, not read (the weight cache's refresh token before the up
    projection; the weight gradient before ``dh``, so a compiled graph frees the bf16 operands first, as
    eager runs do; and there the bf16 weights, so a compiled backward saves them and checks their version
    counters as eager's does, :func:`_setup`)."""
    return gemms._mm_rows(q_RI, s_R, w, w_s, offsets_e, out_dtype, gemms.fp8_native(q_RI, *dims), kind)


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
                 down_t_s: torch.Tensor, wgrad_fp8: bool, watched: list[bool], w_R: Optional[torch.Tensor],
                 copies_TK: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h_RF)`` from the up projection's ``h13_R2F``: ``h = w * silu(h1) * h3`` with its rowwise e4m3
    from the same registers, ``y_RD = h @ w2^T`` on that e4m3; ``y`` is ``y_RD``, or ``y_TD`` (each token's
    copies summed) with ``copies_TK``. Only ``y`` has a gradient; ``h`` is returned for the backward; ``x``
    (not read here) takes the input gradient."""
    h_RF, hq_RF, hs_R = swiglu_quant_forward(h13_R2F, valid, w_R)
    y_RD = gemms._mm_rows(hq_RF, hs_R, down, down_s, offsets_e, x_RD.dtype,
                    gemms.fp8_native(h13_R2F, x_RD.shape[1], w1_eFD.shape[1]), "forward")
    del hq_RF, hs_R  # before the combine allocates its output
    return (y_RD if copies_TK is None else gather_sum(y_RD, copies_TK)), h_RF


@_fp8_experts.register_fake
def _(*inputs):  # type: ignore[no-untyped-def]
    a = ExpertsInputs(*inputs)
    (R, D), F, copies_TK = a.x_RD.shape, a.w1_eFD.shape[1], a.copies_TK
    return a.x_RD.new_empty((R if copies_TK is None else copies_TK.shape[0], D)), a.x_RD.new_empty((R, F))


@torch.library.custom_op("spmdmoe::wgrad_bf16", mutates_args=())
def _wgrad_bf16_op(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor, w_dtype: torch.dtype,
                   split: int) -> list[torch.Tensor]:
    """The weight gradients ``a^T @ b`` per group, unquantized; ``split`` > 0: two of them, ``a``'s columns
    ``[0, split)`` and ``[split, A)``."""
    a_RA = a_RA.contiguous()
    return [gemms._wgrad_plain(a_RA[:, i:j], b_RB, offsets_e, w_dtype) for i, j in gemms._parts(a_RA.shape[1], split)]


@_wgrad_bf16_op.register_fake
def _(a_RA, b_RB, offsets_e, w_dtype, split):  # type: ignore[no-untyped-def]
    e, B = offsets_e.shape[0], b_RB.shape[1]
    return [a_RA.new_empty((e, j - i, B), dtype=w_dtype) for i, j in gemms._parts(a_RA.shape[1], split)]


@torch.library.custom_op("spmdmoe::wgrad_fp8", mutates_args=())
def _wgrad_fp8_op(qa_AP: torch.Tensor, qb_BP: torch.Tensor, sa_eA: torch.Tensor, sb_eB: torch.Tensor,
                  padded_e: torch.Tensor, w_dtype: torch.dtype, split: int, dims: list[int]) -> list[torch.Tensor]:
    """The weight gradients from both operands quantized per (group, column) (:func:`quantize_cols_pair`);
    ``dims``: the layer's ``(D, F)`` (native or emulated, as the forward)."""
    native = gemms.fp8_native(qb_BP.t(), *dims)
    return [gemms._mm_groups(qa_AP[i:j], qb_BP, sa_eA[:, i:j].contiguous(), sb_eB, padded_e, w_dtype, native)
            for i, j in gemms._parts(qa_AP.shape[0], split)]


@_wgrad_fp8_op.register_fake
def _(qa_AP, qb_BP, sa_eA, sb_eB, padded_e, w_dtype, split, dims):  # type: ignore[no-untyped-def]
    e, B = padded_e.shape[0], qb_BP.shape[0]
    return [qa_AP.new_empty((e, j - i, B), dtype=w_dtype) for i, j in gemms._parts(qa_AP.shape[0], split)]


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
    a = ExpertsInputs(*inputs)
    ctx.w_dtype, ctx.wgrad_fp8, ctx.dims = a.w1_eFD.dtype, a.wgrad_fp8, [a.x_RD.shape[1], a.w1_eFD.shape[1]]
    # The watched bf16 weights are saved for their version counters alone (fp8_swiglu): the cache's refresh writes
    # without bumping the cached tensors' counters (a pending backward saved them; an unchanged weight rewrites
    # nothing), so an in-place change of the weights between a forward and its backward (an optimizer step)
    # raises in that backward, as in the bf16 layer, instead of reading what a later forward re-quantized.
    # The backward passes them to dh's GEMM (unread), so a compiled backward saves and checks them too.
    held = [w for w, keep in zip((a.w1_eFD, a.w2_eDF, a.w3_eFD), a.watched) if keep]
    ctx.save_for_backward(a.offsets_e, a.valid, a.up_t, a.up_t_s, a.down_t, a.down_t_s, a.w_R, a.copies_TK, *held)
    # The activations in a box, not saved: the backward drops each once it has read it, so none is alive
    # longer than in the bf16 layer (detached aliases: no reference back to this node).
    ctx.box = {"x": a.x_RD.detach(), "h13": a.h13_R2F.detach(), "h": output[1].detach()}
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
        return (None,) * len(ExpertsInputs._fields)
    offsets_e, valid, up_t, up_t_s, down_t, down_t_s, w_R, copies_TK, *weights = ctx.saved_tensors
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
    dh_RF = _fp8_mm(gq_RD, gs_R, down_t, down_t_s, offsets_e, dtype, dims, "dgrad", [dw2, *weights])
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
    needs = ExpertsInputs(*ctx.needs_input_grad)
    dx = _fp8_mm(q13_R2F, s13_R, up_t, up_t_s, offsets_e, dtype, dims, "dgrad", []) if needs.x_RD else None
    dw = dw_R.to(w_R.dtype) if w_R is not None and needs.w_R else None
    grads = {"x_RD": dx, "w1_eFD": dw1, "w2_eDF": dw2, "w3_eFD": dw3, "w_R": dw}  # the others: None
    return tuple(grads.get(name) for name in ExpertsInputs._fields)


_fp8_experts.register_autograd(_grad, setup_context=_setup)
assert ExpertsInputs._fields == tuple(inspect.signature(_fp8_experts._init_fn).parameters), \
    "ExpertsInputs must list _fp8_experts' parameters in order"


def fp8_swiglu(x_RD: torch.Tensor, offsets_e: torch.Tensor, valid: torch.Tensor, w1_eFD: torch.Tensor,
               w2_eDF: torch.Tensor, w3_eFD: torch.Tensor, quantized: Fp8Weights, wgrad: str = "auto",
               x_fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               w_R: Optional[torch.Tensor] = None, copies_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y_RD`` of the routed rows ``[0, valid)`` through the FP8 experts (rows past ``valid``: unspecified).
    ``quantized``: the weights' FP8 copies (``Fp8WeightCache.get`` or :func:`quantize_weights`); ``wgrad``: ``"auto"``,
    ``"fp8"`` or ``"bf16"`` (:func:`fp8_wgrad`); ``x_fp8``: ``x``'s rowwise e4m3 and scales when the dispatch made them
    (``RoutedTokens.fp8_rows``), bit for bit ``quantize_rows(x_RD)``; ``w_R``: each row's routing weight when the
    dispatch folded them in (the SwiGLU output row times it); ``copies_TK``: the rows of each token's copies
    (``RoutedTokens.copies_TK``): ``y_TD``, the sum of each token's copies, instead (the combine inside the experts'
    node, whose backward then quantizes each token's output gradient once for its ``K`` copies)."""
    q, dims = quantized, [x_RD.shape[1], w1_eFD.shape[1]]
    in_fp8 = gemms.fp8_wgrad(x_RD.shape[1], w1_eFD.shape[1], w1_eFD.shape[0], x_RD.dtype, wgrad)
    xq, xs = x_fp8 or quantize_rows(x_RD.detach(), valid)
    after = [] if q.ready is None else [q.ready]
    h13_R2F = _fp8_mm(xq, xs, q.up, q.up_s, offsets_e, x_RD.dtype, dims, "forward", after)
    del xq, xs
    # parameters and views of them: no bytes of their own, so the node saves them to check their version counters
    # (a cast, which an integration's read_weights may return, would be kept alive for no check: nothing writes it)
    watched = [w.is_leaf or w._base is not None for w in (w1_eFD, w2_eDF, w3_eFD)]
    y, _ = _fp8_experts(x_RD, w1_eFD, w2_eDF, w3_eFD, offsets_e, valid, h13_R2F, q.up_t, q.up_t_s, q.down, q.down_s,
                        q.down_t, q.down_t_s, in_fp8, watched, w_R, copies_TK)
    return y
